from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
BIN = Path(sys.executable).parent


def console_script(name: str) -> str:
    """The installed console script next to this interpreter (what a user runs)."""
    path = BIN / name
    assert path.exists(), f"{name} is not installed in {BIN}; run: pip install -e '.[dev]'"
    return str(path)


def run_cli(args: list[str], cwd: Path, timeout: float = 600, env: dict | None = None):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.fixture
def compose():
    """Compose the shipped config with overrides, as grpo-train would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    import grpo_cli.train  # noqa: F401  registers the schema and the run-id resolver

    def _compose(overrides: list[str] | None = None):
        with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
            return hydra_compose(config_name="config", overrides=overrides or [])

    return _compose
