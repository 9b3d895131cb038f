"""The learnable band: k samples a prompt -> pass rates (`pass_rates`, over grpo-eval's grading),
and the training prompts whose pass rate lies in data.pass_rate_band (`in_band`).

A prompt the policy always solves or never solves gives a group whose rewards are all equal: no
advantage, no gradient (ref 002). prime-rl and verl filter such prompts by difficulty, and the
"perfectible subset" sanity check (arXiv 2510.26788) trains only on problems the starting model
solves 20-80% of the time, where a sound trainer drives training accuracy above 95%. grpo-train
measures the band once, after the warm-up and before the first GRPO step, from a seed stream of its
own (step 0 of distributed.prompt_seed, which no GRPO step uses), keeps the prompts inside it and
stores their indices in the run (TrainerState.band, band.json): a resumed run reuses them.
grpo-eval --band reports how many prompts lie inside a band, per group.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grpo_cli.errors import UserError

BAND_FILE = "band.json"


def check_band(cfg) -> list[str]:
    """data.pass_rate_band and data.band_samples (config validation)."""
    d = cfg.data
    band = None if d.pass_rate_band is None else list(d.pass_rate_band)
    if band is None:  # (data.band_samples without a band: config.validation.unused_settings)
        return []
    problems = []
    if (
        len(band) != 2
        or not all(isinstance(v, (int, float)) for v in band)
        or not 0 <= band[0] <= band[1] <= 1
    ):
        problems.append(
            f"data.pass_rate_band={band} must be two pass rates [low, high] with 0 <= low <= high <= 1, "
            "e.g. data.pass_rate_band=[0.2,0.8]."
        )
    if d.band_samples < 2:
        problems.append(
            f"data.band_samples={d.band_samples} must be >= 2 (the samples a prompt's pass rate is measured "
            "from), e.g. 8."
        )
    from grpo_cli.rewards import build_rewards, correctness

    try:
        specs = build_rewards(cfg.reward, none_ok=True)
    except UserError:  # (the rewards' own check names the problem)
        return problems
    if correctness(specs) is None:
        problems.append(
            "data.pass_rate_band needs a correctness reward (a pass rate is the share of samples it passes), "
            "and none is configured: add one (reward=[accuracy,...], or a reward with role: correctness), or "
            "drop data.pass_rate_band."
        )
    return problems


def pass_rates(rollouts, examples: list, samples: int, seed: int, dist=None) -> list[float | None]:
    """Each example's pass rate: the share of its `samples` completions (the sampler's settings,
    prompt i from distributed.prompt_seed(seed, 0, i)) that the accuracy rule counts and passes
    (Scored.accuracy); None where it counts none. `dist`: several processes grade a shard each
    (every rank gets every rate)."""
    from grpo_cli.distributed import prompt_seed, shard

    rank, world = (dist.rank, dist.world_size) if dist is not None and dist.enabled else (0, 1)
    mine = shard(len(examples), rank, world)
    chunk = [examples[i] for i in mine]
    graded = rollouts.grade(
        chunk, num_generations=samples, greedy=False, seeds=[prompt_seed(seed, 0, i) for i in mine]
    )
    rates = rates_of(graded, len(chunk))
    if world > 1:
        rates = [r for part in dist.gather(rates) for r in part]
    return rates


def rates_of(graded, n: int) -> list[float | None]:
    """The pass rate of each of the n prompts of a graded draw (evaluate.grade's Scored, rows
    grouped by prompt_index): the share of its rows the accuracy rule counts that pass; None where
    it counts none."""
    counts = [[0, 0] for _ in range(n)]  # per prompt: (passed, counted)
    if graded is not None:
        flags = zip(graded.prompt_index.tolist(), graded.passed.tolist(), graded.applies.tolist())
        for j, passed, applies in flags:
            counts[j][0] += bool(passed and applies)
            counts[j][1] += bool(applies)
    return [p / c if c else None for p, c in counts]


def in_band(rates: Sequence[float | None], band: Sequence[float]) -> list[int]:
    """The indices whose pass rate lies in [low, high], both ends included (None: never)."""
    low, high = band
    return [i for i, r in enumerate(rates) if r is not None and low <= r <= high]


@dataclass(frozen=True)
class BandReport:
    """What a band kept: the indices into the prompts, per group (data.eval_group_by's value)
    (kept, of), the probe's completions and seconds."""

    kept: list[int]
    total: int
    groups: dict[str, tuple[int, int]]
    completions: int
    seconds: float

    def line(self, band: Sequence[float], samples: int) -> str:
        by_group = ", ".join(f"{name} {k}/{n}" for name, (k, n) in self.groups.items())
        return (
            f"band: {len(self.kept)} of {self.total} training prompts have a pass rate in "
            f"[{band[0]:g}, {band[1]:g}] ({samples} samples each, {self.completions} completions in "
            f"{self.seconds:.0f} s, not counted in the run's)" + (f"; {by_group}" if by_group else "")
        )


def by_group(examples: list, kept: list[int], column: str | None) -> dict[str, tuple[int, int]]:
    """(kept, of) per value of `column` (data.eval_group_by) of the examples; {} without one."""
    from grpo_cli.evaluate import group_values

    names = group_values(examples, column)
    if not names:
        return {}
    chosen = set(kept)
    out = {}
    for name in names:
        rows = [i for i, ex in enumerate(examples) if str(ex.columns.get(column)) == name]
        out[name] = (sum(i in chosen for i in rows), len(rows))
    return out


def too_few(report: BandReport, band, prompts_per_step: int) -> UserError:
    return UserError(
        f"data.pass_rate_band={list(band)} keeps {len(report.kept)} of {report.total} training prompts, fewer "
        f"than one step's trainer.prompts_per_step={prompts_per_step}"
        + (
            f" (per group: {', '.join(f'{n} {k}/{t}' for n, (k, t) in report.groups.items())})"
            if report.groups
            else ""
        )
        + ": widen the band, raise data.band_samples (a rate from more samples lands between 0 and 1 more "
        "often), warm the model up first (sft=demonstrations), or lower trainer.prompts_per_step."
    )


def write_band(run_dir: Path, report: BandReport, band, samples: int, rates: list[float | None]) -> None:
    """band.json in the run folder: the band, what it kept and every prompt's rate."""
    from grpo_cli.files import write_atomic

    record = {
        "pass_rate_band": list(band),
        "band_samples": samples,
        "kept": report.kept,
        "total": report.total,
        "groups": {k: list(v) for k, v in report.groups.items()},
        "completions": report.completions,
        "seconds": round(report.seconds, 3),
        "pass_rates": rates,
    }
    write_atomic(run_dir / BAND_FILE, json.dumps(record) + "\n")
