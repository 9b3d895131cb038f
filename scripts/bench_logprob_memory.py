#!/usr/bin/env python
"""Peak memory and time of the log-prob phase of a training step: the policy's forward over a
micro-batch of completions, its per-token log-probs and entropy (logprobs.TokenLogprobs), and the
backward of a loss on them. Random-init model of a real shape (no hub), each case a fresh process.

    bash scripts/run.sh python scripts/bench_logprob_memory.py                    # Qwen2.5-0.5B shape, 8 x 256
    bash scripts/run.sh python scripts/bench_logprob_memory.py --baseline HEAD~1  # beside an older revision
    bash scripts/run.sh python scripts/bench_logprob_memory.py --precisions fp32 bf16 --json out.json

Per case: 8 completions of one prompt (a GRPO group: one prompt of --prompt-tokens, shared by the
group, and --completion-tokens sampled tokens each, random ids), temperature 0.7 (so the
temperature is applied, not skipped), one warm-up pass, then the measured one. Peak memory is the
process's resident set: the kernel's high-water mark is reset right before the phase
(/proc/self/clear_refs, 5) and read after it (VmHWM); the table gives it above the resident set
at the phase's start (the weights, the inputs), after the forward (log-probs and entropy computed)
and after the backward. --baseline REV runs the same cases on another
revision of grpo-cli (a temporary git worktree) for a before/after comparison.

Prints a table and writes the result, one row per case and repeat (harness.write_result:
scripts/results/logprob_memory.json; --json elsewhere). A benchmark: nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import harness
from bench_qwen_shape import SHAPES  # the model shapes, one source


def worker(args) -> None:
    """One case in this process: print one JSON line."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import grpo_cli.logprobs as lp

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = Qwen2Config(**SHAPES[args.model], attn_implementation="sdpa")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = Qwen2ForCausalLM(config).to(dtype)
    model.train()
    if args.gradient_checkpointing:  # as trainer.gradient_checkpointing=true sets it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    G, P, C, V = args.rows, args.prompt_tokens, args.completion_tokens, config.vocab_size
    prompt = torch.randint(10, V, (1, P)).repeat(G, 1)
    inputs = (
        prompt,
        torch.ones(G, P, dtype=torch.long),
        torch.randint(10, V, (G, C)),
        torch.ones(G, C, dtype=torch.long),
    )
    new_api = "num_generations" in lp.TokenLogprobs.forward.__code__.co_varnames
    chunk = None if args.chunk == "auto" else int(args.chunk)
    if "chunk_size" in lp.TokenLogprobs.__init__.__code__.co_varnames:
        scorer = lp.TokenLogprobs(model, temperature=0.7, shared_prompt=True, chunk_size=chunk)
    else:  # a revision before the chunked path
        scorer = lp.TokenLogprobs(model, temperature=0.7, shared_prompt=True)

    def phase() -> tuple[float, float, int]:
        tick = time.perf_counter()
        out = scorer(*inputs, num_generations=G) if new_api else scorer(*inputs)
        logps = out[0]
        forward, forward_peak = time.perf_counter() - tick, harness.status_kib("VmHWM")
        (logps.float() * torch.randn(G, C)).sum().backward()
        model.zero_grad(set_to_none=True)
        del out, logps
        return forward, time.perf_counter() - tick, forward_peak

    phase()  # warm-up: the allocator's first touches, the gradients' first buffers
    start = harness.status_kib("VmRSS")
    harness.reset_peak()  # VmHWM := the current RSS
    forward, total, forward_peak = phase()
    peak = harness.status_kib("VmHWM")
    print(
        json.dumps(
            {
                "tree": args.tree_name,
                "chunk": args.chunk,
                "gradient_checkpointing": args.gradient_checkpointing,
                "model": args.model,
                "precision": args.precision,
                "rows": G,
                "prompt_tokens": P,
                "completion_tokens": C,
                "start_mib": start / 1024,
                "peak_mib": peak / 1024,
                "forward_peak_mib": (forward_peak - start) / 1024,
                "phase_peak_mib": (peak - start) / 1024,
                "logits_mib": G * C * V * (2 if dtype == torch.bfloat16 else 4) / 2**20,
                "forward_s": forward,
                "forward_backward_s": total,
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen0.5b", choices=sorted(SHAPES))
    parser.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--baseline", help="a git revision to measure beside this tree (e.g. HEAD~1)")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per case, alternating trees")
    parser.add_argument("--json", help="write the result here (default scripts/results/logprob_memory.json)")
    parser.add_argument(
        "--chunks",
        nargs="+",
        default=["0", "auto"],
        help="trainer.logprob_chunk_size values to compare (0: the whole logits; auto: the default)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="the layers checkpointed (each keeps its input only): what is left is mostly the logits",
    )
    parser.add_argument("--chunk", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree-name", default="this", help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    with contextlib.ExitStack() as stack:
        trees = [("this", None)]
        if args.baseline:
            trees.append((args.baseline, stack.enter_context(harness.worktree(args.baseline))))
        for _ in range(args.repeats):
            for precision in args.precisions:
                for name, tree, chunk in [(n, t, c) for n, t in trees for c in args.chunks]:
                    cmd = ["--worker", "--model", args.model, "--precision", precision]
                    cmd += ["--rows", args.rows, "--prompt-tokens", args.prompt_tokens]
                    cmd += ["--completion-tokens", args.completion_tokens, "--threads", args.threads]
                    cmd += ["--tree-name", name, "--chunk", chunk]
                    cmd += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
                    done = harness.run(
                        harness.script(__file__, *cmd),
                        name=f"{name} {precision}: the worker",
                        cwd=tree or harness.ROOT,
                        threads=args.threads,
                        env={"PYTHONPATH": str(tree)} if tree is not None else None,
                    )
                    rows += done.json_lines()
    print(
        f"{args.model}, {args.rows} x ({args.prompt_tokens} prompt + {args.completion_tokens} completion) tokens"
    )
    print(
        f"{'tree':<12}{'chunk':<7}{'precision':<10}{'logits MiB':>11}{'fwd peak MiB':>14}"
        f"{'phase peak MiB':>16}{'fwd s':>8}{'fwd+bwd s':>11}"
    )
    for r in rows:
        print(
            f"{r['tree']:<12}{r.get('chunk', '-'):<7}{r['precision']:<10}{r['logits_mib']:>11.0f}"
            f"{r['forward_peak_mib']:>14.0f}{r['phase_peak_mib']:>16.0f}{r['forward_s']:>8.2f}"
            f"{r['forward_backward_s']:>11.2f}"
        )
    print(f"wrote {harness.write_result('logprob_memory', rows, path=args.json)}")


if __name__ == "__main__":
    main()
