#!/usr/bin/env python
"""What the judge reward's concurrency buys: the time to score a batch at concurrency 8 and at 1.

    .venv/bin/python scripts/bench_judge.py          # writes scripts/results/judge.json

A local OpenAI-compatible server (grpo_cli/testing/judge_server.py) that takes --latency-s per request (as a
judge model's generation would) scores --completions completions; the judge (grpo_cli/rewards/
judge.py) sends them at concurrency 8 and at concurrency 1, the arms alternating, --repeats times
each, through the step's own path (rewards.score_rewards, its time/rewards/judge). Each arm's judge
is built (and its HTTP client connected by one warm-up call) before the timed rounds, as in a run,
where the client lives across steps. Prints a table (median seconds per
batch, the server's most requests in flight, the ratio) and writes the result, one row per arm
(harness.write_result; --out elsewhere). The server is grpo_cli.testing.judge_server, the one the
judge reward's tests use.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import harness

from grpo_cli.rewards import build_rewards, score_rewards
from grpo_cli.testing.judge_server import JudgeServer

ARMS = (8, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the result here (default scripts/results/judge.json)")
    p.add_argument("--latency-s", type=float, default=0.2)
    p.add_argument("--completions", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    completions = [f"{i % 11}" for i in range(args.completions)]  # the server replies 7: any text will do
    prompts = [f"What is {i} + {i}?" for i in range(args.completions)]
    times: dict[int, list[float]] = {c: [] for c in ARMS}
    in_flight: dict[int, int] = {}
    with JudgeServer(reply=lambda request: "7", latency_s=args.latency_s) as server:
        judges = {
            c: build_rewards({"judge": {"base_url": server.url, "model": "judge", "concurrency": c}}).open()
            for c in ARMS
        }

        def score(specs, n: int) -> tuple[list, dict]:
            stats: dict = {}
            _, per = score_rewards(
                specs, completions[:n], prompts=prompts[:n], completion_ids=None, columns={}, stats=stats
            )
            return per["judge"], stats

        try:
            for specs in judges.values():
                score(specs, 1)  # connect
            for _ in range(args.repeats):
                for c, specs in judges.items():
                    server.reset()
                    tick = time.perf_counter()
                    values, stats = score(specs, args.completions)
                    times[c].append(time.perf_counter() - tick)
                    in_flight[c] = max(in_flight.get(c, 0), server.max_in_flight)
                    assert values == [0.7] * args.completions, values
                    assert stats["rewards/judge/failures"] == stats["rewards/judge/retries"] == 0, stats
                    assert stats["rewards/judge/calls"] == args.completions, stats
        finally:
            for specs in judges.values():
                specs.close()

    medians = {c: statistics.median(times[c]) for c in ARMS}
    ratio = medians[1] / medians[8]
    print(f"judge: {args.completions} completions, {args.latency_s:g} s per request, {args.repeats} repeats")
    print(f"{'concurrency':>11}  {'median s':>9}  {'runs s':<24}  {'max in flight':>13}")
    for c in ARMS:
        runs = " ".join(f"{t:.3f}" for t in times[c])
        print(f"{c:>11}  {medians[c]:>9.3f}  {runs:<24}  {in_flight[c]:>13}")
    print(f"concurrency 1 / concurrency 8: {ratio:.2f}x the time (target >= 5x)")

    rows = [
        {
            "concurrency": c,
            "completions": args.completions,
            "latency_s": args.latency_s,
            "repeats": args.repeats,
            "median_s": medians[c],
            "runs_s": times[c],
            "max_in_flight": in_flight[c],
        }
        for c in ARMS
    ]
    notes = f"concurrency 1 took {ratio:.3f}x the time of concurrency 8 (the rows' median_s; target >= 5x)"
    print(f"wrote {harness.write_result('judge', rows, notes=notes, path=args.out)}")
    return 0 if ratio >= 5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
