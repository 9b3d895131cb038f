"""Training from Python: `grpo_cli.train(...)`, the run `grpo-train` makes, started from a
notebook or a script (docs/python-api.md).

    import grpo_cli

    def brevity(completions, **kwargs):           # TRL's reward signature
        return [1.0 if len(c) < 20 else 0.0 for c in completions]

    result = grpo_cli.train(
        ["model=tiny", "trainer.max_steps=8"],    # grpo-train's overrides
        rewards={"brevity": brevity},             # callables, by the name their metrics get
        train_rows=[{"prompt": "Say hi.", "answer": "hi"}, ...],   # or a datasets.Dataset
    )
    result.metrics["eval/accuracy"], result.checkpoint, result.run_dir

It is grpo-train's own path: the overrides and the given parts compose into one config, validated
whole before any model loads (every problem in one UserError); the task's defaults apply
(grpo_cli/config/task.py); the run folder gets the same record, metrics, checkpoints and curves;
`trainer.resume=auto` with the same run_dir resumes. What differs: errors are raised (UserError
for bad input, TrainingDiverged), not printed with an exit status, and it runs in this process
(trainer.num_processes=1).

Rewards given as callables: each becomes `reward.<name>` with fn `grpo_cli.api:given_rewards.<name>`
(the saved config names that path), scored in this process (reward.<name>.workers=0), after the
task's rewards unless the overrides choose the rewards (`reward=[...]`); with rewards and no
`reward=` override, the callables alone score (as TRL's reward_funcs). Rows given in memory are the
`rows` data source (grpo_cli/data/rows.py): training rows, and held-out rows or data.eval_size of
the training rows held out.
"""

from __future__ import annotations

import secrets
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from grpo_cli.errors import TrainingDiverged, UserError

#: the callables of the running call, by reward name (reward.<name>.fn walks to them)
given_rewards = types.SimpleNamespace()


@dataclass(frozen=True)
class RunResult:
    """What a run left: its folder, the last metrics row (the final step's; held-out accuracy as
    eval/accuracy where the run evaluated at its end) and its last checkpoint (None: none saved)."""

    run_dir: Path
    metrics: dict[str, Any]
    checkpoint: Path | None


def train(
    overrides: Iterable[str] = (),
    *,
    rewards: Mapping[str, Callable[..., list]] | None = None,
    train_rows: Any = None,
    eval_rows: Any = None,
    run_dir: str | Path | None = None,
    config_dir: str | Path | None = None,
) -> RunResult:
    """Train as `grpo-train OVERRIDES` would, with `rewards` (name -> TRL-style function) and
    `train_rows` / `eval_rows` (lists of dicts or datasets.Dataset) given in memory. run_dir:
    the run folder (default: outputs/<date>/<time>-<id>, as grpo-train's); config_dir: a folder
    of your own config groups (grpo-train --config-dir)."""
    from grpo_cli.cli.common import compose_config
    from grpo_cli.cli.sweep import RunFailed
    from grpo_cli.cli.train import note_preexisting, run_one
    from grpo_cli.config import RUN_ID
    from grpo_cli.data import rows as given_rows

    overrides = [str(o) for o in overrides]
    folder = Path(run_dir) if run_dir is not None else _default_run_dir(RUN_ID)
    note_preexisting([f"hydra.run.dir={folder}"])  # (a failed run removes only folders it made)
    try:  # (what the call registers is cleared however it ends)
        given = _reward_overrides(rewards or {}, overrides)
        if train_rows is not None:
            given.append("data=rows")
        elif eval_rows is not None:
            raise UserError("eval_rows was given without train_rows; give both, or train_rows alone.")
        overrides = given + overrides  # (the caller's overrides win over what the call added)
        given_rows.given.train = _rows(train_rows, "train_rows") if train_rows is not None else None
        given_rows.given.eval = _rows(eval_rows, "eval_rows") if eval_rows is not None else None
        # (validated once, by run_one, which grpo-train runs too)
        cfg = compose_config(overrides, config_dir=str(config_dir) if config_dir else None, check=False)
        pooled = [n for n in (rewards or {}) if cfg.reward[n].get("workers")]
        if pooled:  # a worker process imports grpo_cli.api afresh: the callable is not there
            raise UserError(
                f"reward.{pooled[0]}.workers={cfg.reward[pooled[0]].workers}: a reward given as a callable runs in "
                "this process; drop the workers, or put the function in a module and name it by import path "
                f"(+reward.{pooled[0]}.fn=my_module:my_function), which worker processes can import."
            )
        if cfg.trainer.num_processes != 1:
            raise UserError(
                f"trainer.num_processes={cfg.trainer.num_processes}: grpo_cli.train runs in this one "
                "process; start several with grpo-train (or torchrun) instead."
            )
        try:
            metrics = run_one(cfg, folder, overrides)
        except RunFailed as exc:  # the error as raised (UserError, TrainingDiverged), not printed
            if isinstance(exc.__cause__, (UserError, TrainingDiverged)):
                raise exc.__cause__ from None
            raise UserError(" ".join(exc.problems)) from exc.__cause__  # (out of memory: the advice)
    finally:
        given_rows.given.train = given_rows.given.eval = None
        for name in list(vars(given_rewards)):
            delattr(given_rewards, name)
    from grpo_cli.checkpoint import list_checkpoints

    found = list_checkpoints(folder)
    return RunResult(folder, metrics, found[-1] if found else None)


def _reward_overrides(rewards: Mapping[str, Callable[..., list]], overrides: list[str]) -> list[str]:
    """The overrides that make `rewards` the run's (each registered in given_rewards)."""
    from grpo_cli.rewards import REGISTRY

    out = []
    if rewards and not any(o.split("=", 1)[0] == "reward" for o in overrides):
        out.append("reward=[]")  # the callables alone, as TRL's reward_funcs
    for name, fn in rewards.items():
        if not (isinstance(name, str) and name.isidentifier()) or name in REGISTRY:
            raise UserError(
                f"rewards: {name!r} cannot name a reward of yours: use an identifier that is not a built-in "
                f"reward's name ({', '.join(REGISTRY)}), e.g. rewards={{'my_reward': fn}}."
            )
        if not callable(fn):
            raise UserError(f"rewards[{name!r}] is {type(fn).__name__}, not a function; give a callable.")
        setattr(given_rewards, name, fn)
        out.append(f"+reward.{name}.fn=grpo_cli.api:given_rewards.{name}")
    return out


def _rows(rows: Any, what: str) -> list[dict]:
    """A list of dicts (or a datasets.Dataset, or any iterable of mappings) as a list of dicts."""
    try:
        out = [dict(row) for row in rows]
    except (TypeError, ValueError) as exc:
        raise UserError(
            f"{what} must be a list of dicts (or a datasets.Dataset) with a prompt column; got "
            f"{type(rows).__name__} ({exc})."
        ) from None
    if not out:
        raise UserError(f"{what} is empty; give at least one row with a prompt.")
    return out


def _default_run_dir(run_id: str) -> Path:
    """outputs/<date>/<time>-<id>, grpo-train's run folder (conf/config.yaml: hydra.run.dir)."""
    now = datetime.now()  # (a suffix of its own: two calls of one process in one second differ)
    name = f"{now.strftime('%H-%M-%S')}-{run_id}{secrets.token_hex(2)}"
    return Path("outputs") / now.strftime("%Y-%m-%d") / name
