"""`grpo-eval`: how good is a model on the held-out split, and is GRPO going to get a signal?

Greedy accuracy, plus pass@1 and pass@G from G samples per prompt with the training sampler's
settings, the per-prompt pass-rate histogram, the fraction of groups whose rewards are all the
same (zero advantage, no learning signal), the mean completion length, and advice when the
sampled pass rate is outside 10%-90% (ref 004's pre-training probe).

    grpo-eval                                        # the default model and data
    grpo-eval model=qwen0.5b data.eval_size=100
    grpo-eval --checkpoint outputs/.../checkpoints/step-000100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from grpo_cli.cli.common import typed_config
from grpo_cli.config import Config
from grpo_cli.errors import UserError, report_and_exit


def evaluate_model(cfg: Config, *, samples: int, num_prompts: int | None, log=print) -> dict:
    import torch

    from grpo_cli.adapters import check_quantization
    from grpo_cli.build import (
        build_data,
        build_tokenizer,
        build_wide_eval,
        eos_token_ids,
        load_policy,
        read_data,
        read_wide_eval,
    )
    from grpo_cli.evaluate import group_values, score_examples
    from grpo_cli.models import tested_architecture
    from grpo_cli.precision import resolve_device, resolve_precision
    from grpo_cli.rewards import build_rewards, correctness, passes
    from grpo_cli.samplers import build_sampler

    t, s = cfg.trainer, cfg.sampler
    rewards = build_rewards(cfg.reward)
    device = resolve_device(t.device)
    precision = resolve_precision(t.precision, device, adapted=cfg.adapter.name != "none")
    check_quantization(cfg.adapter.quantization, device)
    rows = read_data(cfg)
    source, tokenizer = build_tokenizer(cfg, log)
    log(f"grpo-eval device={device} precision={precision.name} model: {source.description}")
    data = build_data(cfg, rows, tokenizer)
    examples = data.eval[:num_prompts] if num_prompts else data.eval
    wide = build_wide_eval(cfg, read_wide_eval(cfg), tokenizer)
    wide = wide[:num_prompts] if num_prompts else wide
    if not examples:
        raise UserError("the held-out split is empty; set data.eval_size > 0 (or data.eval_split).")
    model = load_policy(cfg, source, device, precision, trainable=False)
    sampler = build_sampler(
        s,
        model,
        eos_ids=eos_token_ids(tokenizer, model),
        pad_id=tokenizer.pad_token_id,
        precision=precision,
        fast_decode=tested_architecture(model),
        seed=t.seed,
    )
    judge = correctness(rewards)
    pass_rule = judge.name if judge else "reward>0"
    torch.manual_seed(t.seed)

    def run(group: int, greedy: bool, examples=examples):
        per_prompt_pass, lengths, totals, batch = [], [], [], max(1, 64 // group)
        for start in range(0, len(examples), batch):
            chunk = examples[start : start + batch]
            r = sampler.generate([ex.prompt_ids for ex in chunk], num_generations=group, greedy=greedy)
            _, total, per_reward = score_examples(rewards, tokenizer, chunk, r, group)
            lengths += r.lengths.tolist()
            totals += total
            passed = passes(per_reward, total, judge.name if judge else None)
            for g in range(len(chunk)):
                rew = total[g * group : (g + 1) * group]
                per_prompt_pass.append((sum(passed[g * group : (g + 1) * group]), max(rew) - min(rew) < 1e-6))
        return per_prompt_pass, lengths, totals

    t0 = time.perf_counter()
    greedy_pass, greedy_len, greedy_reward = run(1, True)
    result = {
        "model": source.description + (f" + LoRA adapter {cfg.adapter.path}" if cfg.adapter.path else ""),
        "num_prompts": len(examples),
        "pass_metric": pass_rule,
        "greedy_accuracy": sum(p for p, _ in greedy_pass) / len(examples),
        "greedy_reward": sum(greedy_reward) / len(greedy_reward),
        "greedy_mean_length": sum(greedy_len) / len(greedy_len),
    }
    by = cfg.data.eval_group_by

    def per_group(name: str, passes: list, examples: list) -> None:  # e.g. greedy_accuracy/minus
        for value in group_values(examples, by):
            hits = [p for (p, _), ex in zip(passes, examples) if str(ex.columns.get(by)) == value]
            result[f"{name}/{value}"] = sum(hits) / len(hits)

    per_group("greedy_accuracy", greedy_pass, examples)
    if wide:  # the second held-out set: operands outside the training range
        wide_pass, _, _ = run(1, True, wide)
        result["wide_num_prompts"] = len(wide)
        result["wide_greedy_accuracy"] = sum(p for p, _ in wide_pass) / len(wide)
        per_group("wide_greedy_accuracy", wide_pass, wide)
    if samples >= 1:
        G = samples
        sampled, lengths, totals = run(G, False)
        hist = [0] * (G + 1)
        for p, _ in sampled:
            hist[p] += 1
        result.update(
            {
                "samples_per_prompt": G,
                "temperature": s.temperature,
                "pass@1": sum(p for p, _ in sampled) / (G * len(examples)),
                f"pass@{G}": sum(1 for p, _ in sampled if p > 0) / len(examples),
                "pass_rate_histogram": hist,
                "frac_all_same_groups": sum(1 for _, same in sampled if same) / len(examples),
                "sampled_mean_length": sum(lengths) / len(lengths),
                "sampled_reward": sum(totals) / len(totals),
            }
        )
        for value in group_values(examples, by):  # per kind: how often it samples a right answer
            hits = [p for (p, _), ex in zip(sampled, examples) if str(ex.columns.get(by)) == value]
            result[f"pass@1/{value}"] = sum(hits) / (G * len(hits))
            result[f"pass@{G}/{value}"] = sum(1 for p in hits if p > 0) / len(hits)
        rate = result["pass@1"]
        if rate < 0.10:
            result["advice"] = (
                f"pass rate {rate:.0%} is below 10%: most groups will be all wrong (no "
                "signal). Use easier data, a stronger model, more samples per prompt, or SFT first."
            )
        elif rate > 0.90:
            result["advice"] = (
                f"pass rate {rate:.0%} is above 90%: most groups will be all right (no "
                "signal). Use harder data."
            )
        else:
            result["advice"] = f"pass rate {rate:.0%} is inside 10%-90%: GRPO should get a learning signal."
    result["seconds"] = time.perf_counter() - t0
    sampler.close()
    return result


def print_result(result: dict, console: Console) -> None:
    table = Table(title=f"grpo-eval: {result['num_prompts']} held-out prompts", header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key in ("model", "advice"):
            continue
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    if "advice" in result:
        console.print(f"advice: {result['advice']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, as for grpo-train")
    parser.add_argument("--checkpoint", help="a grpo-cli checkpoint folder (uses its saved config)")
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per prompt for pass@1/pass@G (default: sampler.num_generations; 0 skips)",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="evaluate only the first N held-out prompts"
    )
    parser.add_argument(
        "--output", default="eval.json", help="where to write the JSON result (default eval.json)"
    )
    args = parser.parse_args(argv)
    console = Console()
    try:
        cfg = typed_config(args.overrides, checkpoint=args.checkpoint)
        samples = cfg.sampler.num_generations if args.samples is None else args.samples
        result = evaluate_model(cfg, samples=samples, num_prompts=args.num_prompts, log=console.print)
    except UserError as exc:
        report_and_exit("grpo-eval", [str(exc)])
    print_result(result, console)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
