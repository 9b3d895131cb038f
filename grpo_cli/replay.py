"""Saved rollouts and replay (docs/replay.md).

trainer.save_rollouts=true writes each GRPO step's scored rollouts to the run, right before the
update reads them: `<run>/rollouts/step-000001.safetensors`, one file a step, and
`<run>/rollouts/index.json`, which describes the run (the versions, thread count, world size and
device the updates ran on; the rewards' names and weights; the memory plan) and every step (its
file, rows, the `first` flag, the sampling counts its metrics report).

`grpo-train ... trainer.replay=RUN_DIR` runs the updates again from those files, without sampling
or rewards: each step's record is read back whole (scored.Scored), the torch generator is set to
the state it had right before the original update, and the learner steps as it did. On the same
machine, versions and thread count, with the same config, the weights equal the original run's
bit for bit (tests/test_replay.py); under another loss or optimizer config the replay says what
differs, and the advantages are recomputed from the saved per-reward values under the replay's
config (loss.std, the rewards' weights, ...).

    a step's file, N rows (rollout.Rollout's and scored.Scored's tensors, by their names):
    prompt_ids [N, P], prompt_mask [N, P], completion_ids [N, C], attention_mask [N, C],
    trained_mask [N, C], truncated [N], sampler_logps [N, C], roles [N, C], episode_stats [N, S],
    env_reward [N], values [N, R], totals [N], passed [N], applies [N], prompt_index [N],
    seeds [N] (the row's prompt's sampling seed, round 0: distributed.prompt_seed),
    rng_state.<rank> (torch's CPU generator right before the update, every rank's).

Integer tensors whose values fit are stored as int32 and read back as their own dtype (the
safetensors metadata names each one's); nothing else is converted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_cli.errors import UserError, first_line
from grpo_cli.files import write_atomic
from grpo_cli.rewards import correctness
from grpo_cli.rewards.scoring import passes
from grpo_cli.rollout import Rollout
from grpo_cli.scored import Scored, to

FOLDER = "rollouts"
INDEX = "index.json"
CONFIG = "config.yaml"
FORMAT = 1
_ROLLOUT = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "attention_mask",
    "trained_mask",
    "truncated",
    "sampler_logps",
    "roles",
    "episode_stats",
    "env_reward",
)
_SCORED = ("values", "totals", "passed", "applies", "prompt_index")
_DTYPES = {
    str(d): d for d in (torch.int64, torch.int32, torch.bool, torch.uint8, torch.float32, torch.float64)
}
_DTYPES |= {str(d): d for d in (torch.bfloat16, torch.float16, torch.int16, torch.int8)}

# Config keys that do not change an update (bookkeeping, evaluation, the data and the sampling the
# saved rollouts replace): left out of the comparison a replay makes with the original's config.
_NOT_COMPARED = ("data.", "environment.", "reward")
_NOT_COMPARED_TRAINER = {
    "replay",
    "save_rollouts",
    "resume",
    "quiet",
    "report_to",
    "log_completions",
    "logging_steps",
    "save_steps",
    "keep_last",
    "eval_steps",
    "eval_start",
    "eval_samples",
    "eval_before",
    "best_metric",
    "early_stopping_patience",
    "early_stopping_target",
    "health_checks",
    "distributed_timeout_s",
    "distributed_timeout",
    "memory_limit_gib",
    "max_sampling_tries",
    "max_bad_steps",
    "eval_temperature",
    "device",  # (checked: the CPU)
    "num_processes",  # (checked: the original's)
    "self_check",  # (the saved steps' own `first`)
}


def folder(run_dir: Path) -> Path:
    return Path(run_dir) / FOLDER


def step_file(step: int) -> str:
    return f"step-{step:06d}.safetensors"


def _versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


# ----------------------------------------------------------------------------- saving


def writer(cfg, parts, run_dir: Path, config_yaml: str) -> RolloutWriter | None:
    """A run's writer of its rollouts under trainer.save_rollouts (build.Parts: its rewards, ranks,
    device, memory plan and the step it starts from); None when it saves none, or replays (a
    replay reads rollouts and writes none)."""
    if not cfg.trainer.save_rollouts or parts.rollouts.saved is not None:
        return None
    rewards = list(parts.rollouts.rewards)
    return RolloutWriter(
        run_dir,
        names=[spec.name for spec in rewards],
        weights=[spec.weight for spec in rewards],
        world_size=parts.dist.world_size,
        device=parts.learner.device,
        fit=parts.state.fit,
        config_yaml=config_yaml,
        start_step=parts.state.step,
    )


class RolloutWriter:
    """trainer.save_rollouts: each step's scored rollouts, written by rank 0 (every rank gives its
    generator's state); the index rewritten atomically after each step's file is in place, so a
    killed run leaves only complete steps listed (a resume rewrites the steps after its checkpoint)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        names,
        weights,
        world_size: int,
        device,
        fit: dict | None,
        config_yaml: str,
        start_step: int,
    ):
        self.root = folder(run_dir)
        self.config_yaml = config_yaml  # (written with the first step: what a replay compares with)
        path = self.root / INDEX
        index = json.loads(path.read_text()) if path.is_file() and start_step else {}
        kept = {k: v for k, v in index.get("steps", {}).items() if int(k) <= start_step}  # (a resume's)
        self.index = {
            "format": FORMAT,
            **_versions(),
            "threads": torch.get_num_threads(),
            "world_size": world_size,
            "device": str(device),
            "names": list(names),
            "weights": list(weights),
            "fit": fit,
            "steps": kept,
        }

    def write(self, step: int, sampled, dist, seed: int) -> None:
        """The step's record (step.Sampled: its training groups, None when dynamic sampling kept
        none) and every rank's generator state, as the update is about to read them. Every rank
        calls it (the generator states are gathered)."""
        from grpo_cli.distributed import prompt_seed

        states = dist.gather(torch.get_rng_state())
        if not dist.is_main:
            return
        if self.config_yaml is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / CONFIG, self.config_yaml)
            self.config_yaml = None
        entry = {
            "file": None,
            "rows": 0,
            # (per step: a resume may run with another thread count, process count or device)
            "threads": self.index["threads"],
            "world_size": self.index["world_size"],
            "device": self.index["device"],
            "first": bool(sampled.first),
            "groups": sampled.groups,
            "zero_std_groups": sampled.zero_std_groups,
            "resampled_groups": sampled.resampled_groups,
            "rescued_groups": sampled.rescued_groups,
        }
        if sampled.train is not None:
            s = sampled.train
            tensors = {name: getattr(s.rollout, name) for name in _ROLLOUT}
            tensors |= {name: getattr(s, name) for name in _SCORED}
            tensors["seeds"] = torch.tensor(
                [prompt_seed(seed, step, i, 0) for i in s.prompt_index.tolist()], dtype=torch.int64
            )
            tensors |= {f"rng_state.{rank}": state for rank, state in enumerate(states)}
            stored, dtypes = {}, {}
            for name, t in tensors.items():
                t = t.detach().to("cpu").contiguous()
                dtypes[name] = str(t.dtype)
                stored[name] = _narrow(t)
            metadata = {
                "dtypes": json.dumps(dtypes),
                "num_generations": str(s.num_generations),
                "stat_names": json.dumps(list(s.rollout.stat_names)),
            }
            path = self.root / step_file(step)
            _save(stored, path, metadata)
            entry |= {"file": path.name, "rows": int(s.totals.shape[0]), "bytes": path.stat().st_size}
        self.index["steps"][str(step)] = entry
        write_atomic(self.root / INDEX, json.dumps(self.index, indent=1) + "\n")


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """int64 as int32 where every value fits (token ids, masks, indices): half the bytes, lossless."""
    if t.dtype == torch.int64 and t.numel():
        info = torch.iinfo(torch.int32)
        if info.min <= int(t.min()) and int(t.max()) <= info.max:
            return t.to(torch.int32)
    return t


def _save(tensors: dict, path: Path, metadata: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # (as any file the run writes)
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(
            f"could not write the saved rollouts {path}: {first_line(exc)}. Free disk space, or set "
            "trainer.save_rollouts=false."
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- replaying


@dataclass(frozen=True)
class Saved:
    """The saved rollouts a replay reads (trainer.replay: the original run's folder)."""

    run_dir: Path
    index: dict
    reweigh: tuple[float, ...] | None = None  # the replay's reward weights where they differ
    judge: str | None = None  # the correctness reward's name (rewards.passes: the pass rule)

    @property
    def last_step(self) -> int:
        return max(int(k) for k in self.index["steps"])

    @property
    def fit(self) -> dict | None:
        return self.index.get("fit")

    def draw(self, step: int, device, rank: int):
        """The step's Sampled as the original update read it, and torch's generator set to the
        state it had then (last: nothing may draw between this and the update)."""
        from grpo_cli.step import Sampled

        entry = self.index["steps"].get(str(step))
        if entry is None:
            raise UserError(
                f"trainer.replay={self.run_dir}: step {step} has no saved rollouts (the index lists steps "
                f"{_span(self.index)}). Replay a run that saved every step from its first (trainer.save_rollouts=true)."
            )
        counts = {k: entry[k] for k in ("groups", "zero_std_groups", "resampled_groups", "rescued_groups")}
        if entry["file"] is None:  # dynamic sampling kept no group: the original skipped the update
            return Sampled(train=None, drawn=None, first=entry["first"], **counts)
        tensors, metadata = _load(folder(self.run_dir) / entry["file"])
        scored = to(_scored(tensors, metadata, self.index, self.reweigh, self.judge), device)
        sampled = Sampled(train=scored, drawn=scored, first=entry["first"], **counts)
        torch.set_rng_state(tensors[f"rng_state.{rank}"])
        return sampled


def _span(index: dict) -> str:
    steps = sorted(int(k) for k in index["steps"])
    return f"{steps[0]}-{steps[-1]}" if steps else "none"


def _load(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            dtypes = json.loads(metadata["dtypes"])
            tensors = {name: f.get_tensor(name).to(_DTYPES[dtypes[name]]) for name in f.keys()}
    except (OSError, KeyError, ValueError) as exc:
        raise UserError(
            f"could not read the saved rollouts {path}: {first_line(exc)}. The file is missing or damaged; "
            "run the original again with trainer.save_rollouts=true."
        ) from exc
    return tensors, metadata


def _scored(tensors: dict, metadata: dict, index: dict, reweigh, judge: str | None) -> Scored:
    rollout = Rollout(
        num_generations=int(metadata["num_generations"]),
        stat_names=tuple(json.loads(metadata["stat_names"])),
        **{name: tensors[name] for name in _ROLLOUT},
    )
    values = {name: tensors[name] for name in _SCORED}
    if reweigh is not None:  # the replay's reward weights: the totals again (rewards.scoring's sum)
        totals = weighted_totals(values["values"], reweigh)
        # A row whose scoring failed kept a NaN total (its group left out of the loss): still so.
        values["totals"] = torch.where(values["totals"].isnan(), values["totals"], totals)
        columns = dict(zip(index["names"], values["values"].T.tolist()))  # (the pass rule reads them)
        values["passed"] = torch.tensor(passes(columns, values["totals"].tolist(), judge), dtype=torch.bool)
    return Scored(
        rollout=rollout, names=tuple(index["names"]), weights=tuple(reweigh or index["weights"]), **values
    )


def weighted_totals(values: torch.Tensor, weights) -> torch.Tensor:
    """[N] float64: each row's weighted total over the rewards that gave a value (not NaN), summed
    as rewards.scoring sums them (Python floats, config order)."""
    rows = []
    for row in values.tolist():
        applicable = [(w, v) for w, v in zip(weights, row) if v == v]  # (NaN: none)
        rows.append(float(sum(w * v for w, v in applicable)) if applicable else float("nan"))
    return torch.tensor(rows, dtype=torch.float64)


def open_saved(cfg, rewards, device, world_size: int, log, replay_dir: Path | None = None) -> Saved:
    """The saved rollouts of trainer.replay, checked before any model loads: the folder and its
    index, the device (CPU), the thread count and world size the original ran with, the rewards'
    names (their weights may differ: the totals are recomputed), no warm-up or band to run, a
    folder of its own (`replay_dir`); the versions and the config compared with the original's
    (each difference said)."""
    run_dir = Path(cfg.trainer.replay).expanduser()
    path = folder(run_dir) / INDEX
    key = f"trainer.replay={cfg.trainer.replay}"
    if not path.is_file():
        raise UserError(
            f"{key}: no saved rollouts there ({path} does not exist). Name the folder of a run that "
            "trained with trainer.save_rollouts=true (the one holding rollouts/ and checkpoints/)."
        )
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}: {path} cannot be read ({first_line(exc)}); run the original again.") from exc
    if index.get("format") != FORMAT or not index.get("steps"):
        raise UserError(
            f"{key}: {path} is format {index.get('format')} with {len(index.get('steps') or {})} steps; this "
            f"grpo-cli replays format {FORMAT} with at least one step. Run the original again with this version."
        )
    problems = []
    steps = index["steps"].values()

    def ran(key: str) -> set:  # what the saved steps ran with (per step: a resume may differ)
        return {entry.get(key, index[key]) for entry in steps}

    if torch.device(device).type != "cpu" or any(not str(d).startswith("cpu") for d in ran("device")):
        problems.append(
            f"the original ran on {', '.join(sorted(map(str, ran('device'))))} and the replay runs on {device}; "
            "replay is offered on the CPU only, for rollouts saved on the CPU (trainer.device=cpu for both), where "
            "the same arithmetic in the same order gives the same bits"
        )
    for fact, now, fix in (
        ("threads", torch.get_num_threads(), "start the replay with OMP_NUM_THREADS={}"),
        ("world_size", world_size, "set trainer.num_processes={}"),
    ):
        values = ran(fact)
        if len(values) > 1:
            problems.append(
                f"the saved steps ran with different {fact.replace('_', ' ')} values {sorted(values)} (a resume "
                "with another); a replay runs with one and cannot give every step its own"
            )
        elif values != {now}:
            (value,) = values
            what = "threads (a matrix product's sums split by thread)" if fact == "threads" else "processes"
            problems.append(f"the original ran {value} {what}, this replay {now}; " + fix.format(value))
    if replay_dir is not None and Path(replay_dir).resolve() == run_dir.resolve():
        problems.append(
            "the replay would run in the original's own folder, writing over its checkpoints and metrics (and "
            "comparing its weights with themselves); give the replay a folder of its own (hydra.run.dir=...)"
        )
    names = [spec.name for spec in rewards]
    if names != index["names"]:
        problems.append(
            f"the rewards are {names}, the saved rollouts' {index['names']} (their values are saved per "
            "reward); configure the original's rewards (their weights may differ)"
        )
    if cfg.sft.name != "none":
        problems.append(
            f"sft={cfg.sft.name}: a replay does not run a warm-up (the saved rollouts start at GRPO's first step "
            "from the model's own weights); set sft=none, or replay a run without one"
        )
    if cfg.data.pass_rate_band is not None:
        problems.append(
            "data.pass_rate_band is set: the band chooses prompts by sampling, and the saved rollouts "
            "already hold the prompts; remove it from the replay's command"
        )
    if problems:
        raise UserError(f"{key} cannot replay here: " + "; ".join(problems) + ".")
    here = _versions()
    if any(index.get(k) != v for k, v in here.items()):
        log(
            f"replay: the original ran torch {index.get('torch')} / transformers {index.get('transformers')}, this "
            f"is torch {here['torch']} / transformers {here['transformers']}: the weights may differ in the last bits."
        )
    weights = [spec.weight for spec in rewards]
    reweigh = tuple(weights) if weights != index["weights"] else None
    judge = correctness(list(rewards))
    saved = Saved(run_dir, index, reweigh, judge=judge.name if judge else None)
    differences = config_differences(run_dir, cfg)
    if reweigh is not None:
        differences.append(f"reward weights: {index['weights']} -> {weights} (the totals recomputed)")
    if differences:
        log(
            f"replay: differs from the original in {'; '.join(differences)}: the updates follow this config, and "
            "the weights will not equal the original's."
        )
    log(f"replay: {len(index['steps'])} saved steps ({_span(index)}) of {run_dir}; no sampling, no rewards.")
    return saved


def config_differences(run_dir: Path, cfg) -> list[str]:
    """`key: original -> replay` for every key that can change an update (not data, evaluation or
    bookkeeping: _NOT_COMPARED), against the config the rollouts were saved under; a model that
    differs is refused (the saved token ids are its tokenizer's: resume.MODEL_IDENTITY_KEYS)."""
    import yaml
    from omegaconf import OmegaConf

    from grpo_cli.resume import MODEL_IDENTITY_KEYS, _flatten

    path = folder(run_dir) / CONFIG
    try:
        original = _flatten(yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError) as exc:
        return [f"the original's config ({path}: {first_line(exc)})"]
    here = _flatten(OmegaConf.to_container(OmegaConf.structured(cfg)))
    out = []
    for key in sorted(set(original) | set(here)):
        if key.startswith(_NOT_COMPARED) or (
            key.startswith("trainer.") and key.split(".")[1] in _NOT_COMPARED_TRAINER
        ):
            continue
        a, b = original.get(key, "<absent>"), here.get(key, "<absent>")
        if a == b:
            continue
        if key.removeprefix("model.") in MODEL_IDENTITY_KEYS:
            raise UserError(
                f"trainer.replay={cfg.trainer.replay}: the model differs from the original's ({key}: {a!r} -> "
                f"{b!r}); the saved token ids are that model's. Give the original's command line "
                f"(its overrides are in {Path(run_dir) / 'overrides.yaml'}) plus trainer.replay."
            )
        out.append(f"{key}: {a!r} -> {b!r}")
    return out


def compare_weights(original_run: Path, replayed: Path, step: int) -> str | None:
    """The replay's final checkpoint against the original's at the same step, tensor by tensor
    (every safetensors file of the two folders): a line saying they are equal bit for bit, or how
    many tensors differ and by how much; None when the original has no checkpoint of that step."""
    from safetensors.torch import load_file

    from grpo_cli.checkpoint import checkpoints_dir

    theirs = checkpoints_dir(Path(original_run)) / f"step-{step:06d}"
    if not theirs.is_dir() or replayed is None:
        return None
    files = sorted(p.name for p in Path(replayed).glob("*.safetensors"))
    differ, total, largest = [], 0, 0.0
    for name in files:
        if not (theirs / name).is_file():
            return f"replay: the original's {theirs} has no {name} to compare with."
        a, b = load_file(str(theirs / name)), load_file(str(Path(replayed) / name))
        for key in sorted(set(a) | set(b)):
            total += 1
            if (
                key not in a
                or key not in b
                or a[key].shape != b[key].shape
                or not torch.equal(a[key], b[key])
            ):
                differ.append(key)
                if key in a and key in b and a[key].shape == b[key].shape:
                    largest = max(largest, float((a[key].double() - b[key].double()).abs().max()))
    if not total:
        return None
    if not differ:
        return f"replay: step {step}'s weights equal the original's ({theirs}) bit for bit ({total} tensors)."
    return (
        f"replay: step {step}'s weights differ from the original's ({theirs}) in {len(differ)} of {total} tensors "
        f"(largest difference {largest:.3g}; e.g. {differ[0]})."
    )
