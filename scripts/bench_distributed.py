"""One process vs two (DDP, FSDP2) on this machine, and what FSDP2's decode loop pays to gather
the model: a sanity figure on a CPU (two processes share its cores), the real gains need GPUs.

    python scripts/bench_distributed.py [--steps 4]     # writes scripts/results/distributed.json

Part 1 trains the default recipe (SmolLM2-135M, 4 prompts x 8 completions) for --steps steps
with 1 process (all cores), 2 processes with DDP and 2 with FSDP2 (one core each here), the
three runs one after the other, and reports each phase's median seconds per step (step 1, which
includes the self-check and warm-up, is left out).

Part 2 (under torchrun, 2 processes, FSDP2): the time to gather the whole model once
(distributed.full_weights, what each rollout and each evaluation pays) against the time of one
decode step (8 rows, one token each) with the model gathered and with FSDP2 gathering every
layer inside the forward (what a decode loop without full_weights would pay per token).

The result (harness.write_result; --json elsewhere): one row per training case and one for the
decode measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

RECIPE = ["trainer.eval_before=false", "data.eval_size=8", "trainer.save_steps=1000", "trainer.quiet=true"]
CASES = {
    "1 process": [],
    "2 processes, ddp": ["trainer.num_processes=2"],
    "2 processes, fsdp": ["trainer.num_processes=2", "trainer.distributed=fsdp"],
}
PHASES = ("step_time", "time/rollout", "time/reward", "time/policy", "time/optimizer")


def train(name: str, steps: int, work: Path) -> dict[str, float]:
    run = work / name.replace(" ", "_").replace(",", "")
    overrides = [*RECIPE, f"trainer.max_steps={steps}", *CASES[name]]
    # OMP_NUM_THREADS unset: one process takes every core; with two, the launcher shares them
    metrics = harness.launch(overrides, run, cwd=work, env={"OMP_NUM_THREADS": None}, name=name)
    rows = [r for r in metrics if r.get("step", 0) >= 2 and "step_time" in r]
    return {p: statistics.median(r[p] for r in rows) for p in PHASES}


def gather_worker(out: Path) -> None:
    """Under torchrun: SmolLM2 sharded by FSDP2; time full_weights vs one decode step."""
    import torch
    from hydra import compose, initialize_config_module

    from grpo_cli import distributed
    from grpo_cli.build import build_tokenizer
    from grpo_cli.config import to_typed
    from grpo_cli.models import load_model

    d = distributed.from_env()
    distributed.join(d, "cpu", 600)
    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        cfg = to_typed(compose(config_name="config"))  # the default model (its offline copy)
    source, _ = build_tokenizer(cfg, lambda *a: None)
    model = load_model(source, device=torch.device("cpu"), trainable=False)
    distributed.shard_model(model)
    ids = torch.randint(0, 1000, (8, 1))

    def one_token():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    def timed(fn, n=5):
        ts = []
        for _ in range(n):
            d.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def gather():
        with distributed.full_weights(model):
            pass

    result = {"gather_whole_model_s": timed(gather), "decode_step_sharded_s": timed(one_token)}
    with distributed.full_weights(model):
        result["decode_step_gathered_s"] = timed(one_token)
    if d.is_main:
        out.write_text(json.dumps(result))
    distributed.leave()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--json", type=Path, help="write the result here (default scripts/results/distributed.json)"
    )
    ap.add_argument("--gather-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gather_worker:
        gather_worker(args.gather_worker)
        return
    training: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in CASES:
            training[name] = train(name, args.steps, work)
            print(f"{name}: done", file=sys.stderr, flush=True)
        out = work / "gather.json"
        harness.run(
            harness.torchrun(__file__, "--gather-worker", out, processes=2),
            name="gather benchmark",
            cwd=work,
            threads=max(1, (os.cpu_count() or 2) // 2),
        )
        g = json.loads(out.read_text())

    base = training["1 process"]["step_time"]
    print(f"\nmedian seconds per step (steps 2-{args.steps}), default recipe, {os.cpu_count()} CPU cores")
    print(f"{'case':<20}" + "".join(f"{p.split('/')[-1]:>11}" for p in PHASES) + f"{'vs 1 proc':>11}")
    for name, row in training.items():
        print(
            f"{name:<20}" + "".join(f"{row[p]:>11.2f}" for p in PHASES) + f"{row['step_time'] / base:>10.2f}x"
        )
    print(
        f"\nFSDP2 decode, 2 processes: gather the whole model once {g['gather_whole_model_s'] * 1e3:.1f} ms; "
        f"one decode step {g['decode_step_gathered_s'] * 1e3:.1f} ms gathered vs "
        f"{g['decode_step_sharded_s'] * 1e3:.1f} ms gathering each layer in the forward"
    )
    rows = [{"case": name, "steps": args.steps, **row} for name, row in training.items()]
    rows.append({"case": "fsdp decode, 2 processes", **g})
    print(f"wrote {harness.write_result('distributed', rows, path=args.json)}")


if __name__ == "__main__":
    main()
