#!/usr/bin/env python
"""The hybrid models of issue #61 (Qwen3.5's Gated DeltaNet, LFM2's short convolutions, Granite 4.0's
Mamba-2 layers) beside Llama: the matrix's equalities in fp32, and short grpo-train runs.

    bash scripts/run.sh python scripts/bench_hybrid.py            # both parts
    bash scripts/run.sh python scripts/bench_hybrid.py equalities # one

equalities (in this process, tests/test_architectures.py's tiny models, fp32): per architecture,
- logp_max: the training log-probs (temperature 0.7, left-padded rows of mixed lengths) against each
  row's own unpadded forward, greatest absolute difference, the shared-prompt path and the plain one
  (a hybrid takes the plain one either way);
- grad_rel: their gradients' relative error (norm of the difference over the norm);
- sampler_mean/max: |trainer - sampler| log-prob over 2 prompts x 3 sampled completions of 12 tokens
  (the step-0 self-check's measure), the built-in sampler's decode against the training forward.

runs (fresh grpo-train processes, alternating): each architecture at hidden 128, 4 layers, with the
built-in tiny tokenizer, the default recipe (arithmetic, 4 prompts x 8, 16 tokens, fp32) for --steps
steps, without held-out evaluation: "plain" (trainer.micro_batch_tokens=null) and "budget"
(trainer.micro_batch_tokens=--budget: token micro-batches and length buckets, the fast path the
hybrids keep; the shared-prompt KV cache they do not keep, Llama does in both arms). Median step
seconds after the first; the first step's self-check line. Prints tables and writes
scripts/results/hybrid.json. A benchmark: nothing is asserted.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys

import harness

sys.path.insert(0, str(harness.ROOT / "tests"))

OUT = harness.ROOT / ".bench" / "hybrid"
NAMES = ("llama", "qwen3_5", "lfm2", "granitemoehybrid")


def equalities() -> list[dict]:
    import torch
    from test_architectures import ARCHS, G, batch, build, reference

    from grpo_cli.logprobs import token_logprobs
    from grpo_cli.samplers.builtin import sample

    rows = []
    for name in ARCHS:
        row = {"arch": name}
        model = build(name).eval()
        for shared in (True, False):
            prompts, completions, tensors = batch(shared)
            with torch.no_grad():
                logps = token_logprobs(model, *tensors, temperature=0.7, num_generations=G if shared else 1)
                diff = max(
                    float((logps[i, : len(c)] - reference(model, p, c, 0.7)).abs().max())
                    for i, (p, c) in enumerate(zip(prompts, completions))
                )
            row["logp_max_shared" if shared else "logp_max_plain"] = diff
        model.train()
        prompts, completions, tensors = batch(False)
        weights = torch.linspace(-1.0, 1.0, len(completions))
        logps = token_logprobs(model, *tensors, temperature=0.7, num_generations=1)
        ours = torch.autograd.grad(
            sum(w * logps[i, : len(c)].sum() for i, (w, c) in enumerate(zip(weights, completions))),
            list(model.parameters()),
            allow_unused=True,
        )
        theirs = torch.autograd.grad(
            sum(w * reference(model, p, c, 0.7).sum() for w, p, c in zip(weights, prompts, completions)),
            list(model.parameters()),
            allow_unused=True,
        )
        pairs = [(a, b) for a, b in zip(ours, theirs) if a is not None and b is not None]
        a = torch.cat([x.flatten() for x, _ in pairs])
        b = torch.cat([y.flatten() for _, y in pairs])
        row["grad_rel"] = float((a - b).norm() / b.norm())
        model.eval()
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 103, (n,), generator=g).tolist() for n in (5, 11)]
        out = sample(
            model,
            prompts,
            num_generations=3,
            max_new_tokens=12,
            temperature=1.0,
            eos_ids=[],
            pad_id=0,
            seeds=[1, 2],
        )
        with torch.no_grad():
            scored = token_logprobs(model, *out.inputs(), temperature=1.0, num_generations=3)
        d = (scored - out.sampler_logps)[out.attention_mask.bool()].abs()
        row["sampler_mean"], row["sampler_max"] = float(d.mean()), float(d.max())
        rows.append(row)
    return rows


def _folder(name: str):
    """The architecture at hidden 128, 4 layers, random weights, saved once."""
    import torch
    import transformers as tf
    from test_architectures import DECODER, HYBRIDS

    folder = OUT / "models" / name
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    wider = DECODER | dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**wider))
    else:
        config = HYBRIDS[name]().config.to_dict()
        config.update(hidden_size=128, intermediate_size=256, num_hidden_layers=4)
        if name == "granitemoehybrid":
            config.update(
                layer_types=["mamba", "attention", "mamba", "mamba"],
                shared_intermediate_size=256,
                mamba_d_head=64,
            )
        if name == "lfm2":
            config.update(block_ff_dim=256)
        model = type(HYBRIDS[name]())(type(HYBRIDS[name]().config).from_dict(config))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def run_arm(name: str, arm: str, steps: int, budget: int) -> dict:
    from grpo_cli.models import build_tiny

    run_dir = OUT / f"{name}-{arm}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        "model=tiny",
        f"model.name_or_path={_folder(name)}",
        f"model.tokenizer={build_tiny()}",
        "data.eval_size=0",
        "trainer.eval_before=false",
        "trainer.save_steps=1000",
        f"trainer.max_steps={steps}",
        "trainer.precision=fp32",
        f"trainer.micro_batch_tokens={'null' if arm == 'plain' else budget}",
    ]
    done = harness.train(overrides, run_dir, name=f"{name}/{arm}")
    steps_rows = harness.step_rows(run_dir)
    check = re.search(r"self-check ok: ([^\n]*)", done.output)
    return {
        "arch": name,
        "arm": arm,
        "steps": len(steps_rows),
        "step_s": harness.median(r["step_time"] for r in steps_rows[1:]),
        "policy_s": harness.median(r["time/policy"] for r in steps_rows[1:]),
        "rollout_s": harness.median(r["time/rollout"] for r in steps_rows[1:] if "time/rollout" in r),
        "reward_last": steps_rows[-1].get("reward"),
        "self_check": check.group(1)[:90] if check else "(none)",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", nargs="?", choices=["equalities", "runs"], default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--budget", type=int, default=256)
    a = p.parse_args()
    result = {"machine": harness.fingerprint()}
    if a.part in (None, "equalities"):
        result["equalities"] = equalities()
        harness.print_table(
            result["equalities"],
            ["arch", "logp_max_shared", "logp_max_plain", "grad_rel", "sampler_mean", "sampler_max"],
        )
    if a.part in (None, "runs"):
        runs = []
        for _, pair in harness.interleave([f"{n}/{arm}" for n in NAMES for arm in ("plain", "budget")], 1):
            name, arm = pair.split("/")
            runs.append(run_arm(name, arm, a.steps, a.budget))
        result["runs"] = runs
        harness.print_table(runs, ["arch", "arm", "steps", "step_s", "policy_s", "rollout_s", "reward_last"])
        for r in runs:
            print(f"{r['arch']}/{r['arm']}: self-check ok: {r['self_check']}")
    harness.write_json(harness.ROOT / "scripts" / "results" / "hybrid.json", result)


if __name__ == "__main__":
    main()
