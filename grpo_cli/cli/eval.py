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


def evaluate_model(
    cfg: Config, *, samples: int, num_prompts: int | None, log=print, band: list[float] | None = None
) -> dict:
    """grpo-eval's metrics (the module docstring's), on grpo-train's set-up (build.build_front:
    the same checks, seed, tokenizer and data) and its evaluator (Rollouts.grade). band: [low,
    high], also how many prompts have a sampled pass rate inside it (band.in_band), per group."""
    from grpo_cli.build import build_front, build_rollouts, load_policy
    from grpo_cli.evaluate import group_accuracy, group_values
    from grpo_cli.loss import zero_std_groups
    from grpo_cli.rewards import correctness

    s, by = cfg.sampler, cfg.data.eval_group_by
    front = build_front(cfg, log, command="grpo-eval")
    source, rewards, at = front.source, front.rewards, front.at
    examples = front.data.eval[:num_prompts] if num_prompts else front.data.eval
    wide = front.wide_eval[:num_prompts] if num_prompts else front.wide_eval
    if not examples:
        raise UserError("the held-out split is empty; set data.eval_size > 0 (or data.eval_split).")
    model = load_policy(cfg, source, at.device, at.precision, trainable=False)
    rollouts = build_rollouts(cfg, model, front.tokenizer, rewards, at)
    try:
        judge = correctness(rewards)

        def run(group: int, greedy: bool, examples=examples):  # the evaluator of grpo-train too
            return rollouts.grade(examples, num_generations=group, greedy=greedy)

        def per_group(name: str, graded, examples) -> None:  # e.g. greedy_accuracy/minus
            """The accuracy rule per value of data.eval_group_by; pass@G: a prompt with any pass."""
            G = graded.num_generations
            for value, group in group_accuracy(graded, examples, by, group_values(examples, by)).items():
                result[f"{name}/{value}"] = group.passed / group.counted if group.counted else 0.0
                if G > 1:
                    result[f"pass@{G}/{value}"] = (
                        group.prompts_passed / group.prompts if group.prompts else 0.0
                    )

        def accuracy(graded) -> float:
            right, counted = graded.accuracy()
            return right / counted if counted else 0.0

        t0 = time.perf_counter()
        greedy = run(1, True)
        result = {
            "model": source.description + (f" + LoRA adapter {cfg.adapter.path}" if cfg.adapter.path else ""),
            "num_prompts": len(examples),
            "pass_metric": judge.name if judge else "reward>0",
            "greedy_accuracy": accuracy(greedy),
            "greedy_reward": greedy.totals.mean().item(),
            "greedy_mean_length": greedy.rollout.lengths.double().mean().item(),
        }
        per_group("greedy_accuracy", greedy, examples)
        result.update(_env_means("greedy", greedy))
        if wide:  # the second held-out set: operands outside the training range
            wide_graded = run(1, True, wide)
            result["wide_num_prompts"] = len(wide)
            result["wide_greedy_accuracy"] = accuracy(wide_graded)
            per_group("wide_greedy_accuracy", wide_graded, wide)
        if samples >= 1:
            G = samples
            sampled = run(G, False)
            # The rule training uses to drop a group as signal-free (loss.std, loss.zero_std_threshold).
            same = zero_std_groups(
                sampled.totals, G, std=cfg.loss.std, zero_std_threshold=cfg.loss.zero_std_threshold
            )
            result.update(_sampled_metrics(sampled, same, s.temperature))
            result.update(_env_means("sampled", sampled))
            per_group("pass@1", sampled, examples)  # per kind: how often it samples a right answer
            result["advice"] = _advice(result["pass@1"])
            if band is not None:
                result.update(_band_counts(sampled, examples, band, by))
        result["seconds"] = time.perf_counter() - t0
    finally:
        rollouts.close()
    return result


def _sampled_metrics(sampled, same, temperature: float) -> dict:
    """pass@1 (the accuracy rule over sampled completions), pass@G, the pass-rate histogram, the
    share of signal-free groups (`same`: [prompts] bool), mean length and reward."""
    from grpo_cli.metrics import pass_rate_histogram

    G = sampled.num_generations
    right, counted = sampled.accuracy()
    return {
        "samples_per_prompt": G,
        "temperature": temperature,
        "pass@1": right / counted if counted else 0.0,
        f"pass@{G}": sampled.passed.view(-1, G).any(-1).double().mean().item(),  # ([prompts, G])
        "pass_rate_histogram": pass_rate_histogram(sampled.passed.tolist(), G),
        "frac_all_same_groups": same.double().mean().item(),
        "sampled_mean_length": sampled.rollout.lengths.double().mean().item(),
        "sampled_reward": sampled.totals.mean().item(),
    }


def _band_counts(sampled, examples, band: list[float], column: str | None) -> dict:
    """How many prompts have a pass rate (over their sampled completions) in [low, high], of how
    many, per value of data.eval_group_by too: what data.pass_rate_band would keep of them."""
    from grpo_cli.band import by_group, in_band, rates_of

    kept = in_band(rates_of(sampled, len(examples)), band)
    out = {"band": f"[{band[0]:g}, {band[1]:g}]", "in_band": len(kept), "in_band_of": len(examples)}
    for name, (k, n) in by_group(examples, kept, column).items():
        out[f"in_band/{name}"] = f"{k}/{n}"
    return out


def _env_means(name: str, graded) -> dict[str, float]:
    """An environment's episode metrics (env/turns, env/tool_call_rate, ...) over the prompts."""
    from grpo_cli.evaluate import env_means

    names, sums = env_means(graded)
    prompts = len(graded.totals) // graded.num_generations
    return {f"{name}_{k}": total / prompts for k, total in zip(names, sums)}


def _advice(rate: float) -> str:
    """Ref 004's pre-training probe: is the sampled pass rate inside 10%-90%?"""
    if rate < 0.10:
        return (
            f"pass rate {rate:.0%} is below 10%: most groups will be all wrong (no "
            "signal). Use easier data, a stronger model, more samples per prompt, or SFT first."
        )
    if rate > 0.90:
        return (
            f"pass rate {rate:.0%} is above 90%: most groups will be all right (no signal). Use harder data."
        )
    return f"pass rate {rate:.0%} is inside 10%-90%: GRPO should get a learning signal."


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
    parser.add_argument(
        "--band",
        nargs=2,
        type=float,
        metavar=("LOW", "HIGH"),
        help="also count the prompts whose sampled pass rate lies in [LOW, HIGH] (data.pass_rate_band), per group",
    )
    args = parser.parse_args(argv)
    if args.band is not None and not 0 <= args.band[0] <= args.band[1] <= 1:
        parser.error(f"--band {args.band[0]:g} {args.band[1]:g}: give LOW HIGH with 0 <= LOW <= HIGH <= 1")
    console = Console()
    try:
        cfg = typed_config(args.overrides, checkpoint=args.checkpoint)
        samples = cfg.sampler.num_generations if args.samples is None else args.samples
        if args.band is not None and samples < 2:
            raise UserError(f"--band needs --samples of 2 or more (a pass rate per prompt); it is {samples}.")
        result = evaluate_model(
            cfg, samples=samples, num_prompts=args.num_prompts, log=console.print, band=args.band
        )
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
