from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
BIN = Path(sys.executable).parent
TESTS = ROOT / "tests"


# The tiny model's overrides that every tiny-model run of the suite starts from: the built-in
# 0.2M-parameter Llama (models.build_tiny), 64 arithmetic prompts, 4 completions of up to 8 tokens.
TINY_BASE = [
    "model=tiny",
    "data.num_examples=64",
    "sampler.num_generations=4",
    "sampler.max_new_tokens=8",
    "trainer.quiet=true",
]


def tiny(*overrides: str) -> list[str]:
    """TINY_BASE and a test file's own overrides (a later value of the same key wins)."""
    return [*TINY_BASE, *overrides]


def console_script(name: str) -> str:
    """The installed console script next to this interpreter (what a user runs)."""
    path = BIN / name
    assert path.exists(), f"{name} is not installed in {BIN}; run: pip install -e '.[dev]'"
    return str(path)


def run_cli(args: list[str], cwd: Path, timeout: float = 600, env: dict | None = None):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def grpo_env(extra: dict | None = None) -> dict:
    """The environment of a grpo-train run in a test: offline, one thread, tests/ importable
    (reward fixtures, fault injection), and nothing of the caller's Hydra, fault or torchrun
    settings unless `extra` sets them."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    for key in (
        "HYDRA_FULL_ERROR",
        "GRPO_TEST_FAULT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(key, None)
    env.update(extra or {})
    return env


def grpo(
    args: list[str],
    cwd: Path,
    *,
    env: dict | None = None,
    fault: str | None = None,
    file_size_limit: int | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """Run grpo-train: the installed console script, or (with `fault`) the same entry point
    through tests/reliability_helpers.py, which injects the fault first (and which
    trainer.num_processes then runs in every worker)."""
    import resource

    extra = dict(env or {})
    if fault:
        cmd = [sys.executable, "-c", "import reliability_helpers as h; h.main()", *args]
        extra["GRPO_TEST_FAULT"] = fault
    else:
        cmd = [console_script("grpo-train"), *args]

    def limit():  # a disk that fills up: writes past this size fail (EFBIG, like ENOSPC)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=grpo_env(extra),
        preexec_fn=limit if file_size_limit else None,
    )


#: A chat template whose turns end at EOS (</s>), for the environment tests' tiny model.
EOS_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_model():
    """The built-in tiny model (seeded) and its tokenizer with EOS_TEMPLATE: the environment
    tests' model."""
    import torch

    from grpo_cli.models import load_model, load_tokenizer, resolve_source

    src = resolve_source("builtin:tiny")
    tok = load_tokenizer(src)
    tok.chat_template = EOS_TEMPLATE
    torch.manual_seed(0)
    return load_model(src, device=torch.device("cpu")), tok


@pytest.fixture
def compose():
    """Compose the shipped config with overrides, as grpo-train would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    import grpo_cli.config  # noqa: F401  registers the schema and the run-id resolver

    def _compose(overrides: list[str] | None = None):
        with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
            return hydra_compose(config_name="config", overrides=overrides or [])

    return _compose


# A test that starts a process (a console script, a fault-injecting grpo-train) is in the slow
# tier; `pytest -m "not slow"` runs the rest, the inner loop of development (under 2 minutes).
_STARTS_A_PROCESS = ("run_cli(", "console_script(", "subprocess.", "start(", "grpo(")


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        try:
            source = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            source = ""
        if any(call in source for call in _STARTS_A_PROCESS):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    # Under pytest-xdist each worker is a process of its own: two workers with torch's default of
    # one thread per core would wait on each other on a 2-core machine.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def scored_rows(rollout, totals, per_reward=None):
    """A scored.Scored of a rollout with given totals ([N] floats, NaN: could not score) and
    per-reward values (name -> [N] floats or None; default: one reward "x" equal to the totals);
    the pass rule: total > 0 (no correctness reward)."""
    import math

    import torch

    from grpo_cli.scored import Scored

    totals = [float(t) for t in totals]
    per_reward = per_reward or {"x": totals}
    G = rollout.num_generations
    return Scored(
        rollout=rollout,
        names=tuple(per_reward),
        values=torch.tensor(
            [[math.nan if v is None else v for v in column] for column in per_reward.values()],
            dtype=torch.float64,
        ).T,
        totals=torch.tensor(totals, dtype=torch.float64),
        passed=torch.tensor([t > 0 for t in totals]),
        applies=torch.ones(len(totals), dtype=torch.bool),
        prompt_index=torch.arange(len(totals) // G).repeat_interleave(G),
    )
