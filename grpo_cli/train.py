"""`grpo-train`: compose the config, validate it, hand plain objects to the engine.

No training logic lives here. The engine never reads Hydra state: this module reads the run
folder once and passes it down.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from grpo_cli.config import register_configs, validate
from grpo_cli.errors import UserError, report_and_exit

# One id per process: two runs started in the same second get different folders.
_RUN_ID = f"{os.getpid()}{secrets.token_hex(2)}"
OmegaConf.register_new_resolver("grpo_run_id", lambda: _RUN_ID, replace=True)
register_configs()

_task_started = False


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_run_record(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> None:
    """The resolved config and the command-line overrides, next to everything the run writes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    _write_atomic(run_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))


def _discard_if_nothing_trained(run_dir: Path) -> None:
    """Bad input found while building (data, model, rewards): leave no run folder behind."""
    if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists():
        for name in ("config.yaml", "overrides.yaml"):
            (run_dir / name).unlink(missing_ok=True)
        _remove_if_empty(run_dir)


def _remove_if_empty(run_dir: Path) -> None:
    """Hydra creates the run folder (and its parents) before our task runs; a rejected config
    leaves nothing behind: remove the empty folders up to, not including, the working dir."""
    cwd = Path.cwd().resolve()
    path = run_dir.resolve()
    while path != cwd and cwd in path.parents:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


@hydra.main(version_base="1.3", config_path="pkg://grpo_cli.conf", config_name="config")
def _train(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    problems = validate(cfg)
    if problems:
        _remove_if_empty(run_dir)
        report_and_exit("grpo-train: invalid configuration", problems)
    save_run_record(cfg, run_dir, list(hydra_cfg.overrides.task))
    try:
        from grpo_cli.engine import run

        run(cfg, run_dir)
    except UserError as exc:
        _discard_if_nothing_trained(run_dir)
        report_and_exit("grpo-train", [str(exc)])


def main() -> None:
    try:
        _train()
    except SystemExit as exc:
        # Hydra reports composition errors (bad type, unknown key or option) and exits 1
        # before our task starts; those are user errors like any other: exit 2.
        if exc.code == 1 and not _task_started:
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
