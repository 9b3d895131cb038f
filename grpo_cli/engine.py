"""The training loop (arrives with the engine issue)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


def run(cfg: DictConfig, run_dir: Path) -> None:
    print(f"config is valid; resolved config saved to {run_dir / 'config.yaml'}")
    print("the training engine is not part of this build yet")
