from __future__ import annotations

import inspect
import os
import re
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


def train_here(overrides: list[str], run_dir: Path, on_start=None) -> dict:
    """Train in this process what `grpo-train OVERRIDES hydra.run.dir=RUN_DIR` trains (its
    hydra.* overrides dropped), through grpo_cli.cli.train.train_config, with one torch thread as
    grpo_env gives a subprocess; the last metrics row. For tests of what a run computes and
    writes: the console script's own behaviour (exit status, stderr, signals) needs `grpo`."""
    import torch

    from grpo_cli.cli.train import train_config

    run_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_config(composed([o for o in overrides if not o.startswith("hydra.")]), run_dir, on_start)
    finally:
        torch.set_num_threads(threads)


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


def composed(overrides: list[str] | None = None):
    """The shipped config composed with overrides, as grpo-train would (also for module-scoped
    fixtures, which cannot use the function-scoped `compose`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from grpo_cli.config import task  # (importing grpo_cli.config registers the schema and resolvers)

    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides or [])
    task.apply(cfg, overrides or [])  # the task's rewards where none are chosen, as grpo-train does
    return cfg


@pytest.fixture
def compose():
    """Compose the shipped config with overrides, as grpo-train would."""
    return composed


# A test that starts a process (a console script, a fault-injecting grpo-train, torchrun) is in the
# slow tier; `pytest -m "not slow"` runs the rest, the inner loop of development (under 2 minutes).
# The marker follows the code a test runs: its own function, every fixture it uses (item.fixturenames
# is already the transitive closure), its parametrized callables, and, transitively, every function
# or class of tests/ that any of these names (a helper module's function, conftest's grpo/run_cli, a
# class's methods). In a run of the fast tier, a process that starts anyway in a test left unmarked
# fails that test, naming the command (_guarded_execute_child below): the marker cannot silently
# miss one.
_PROCESS_NAMES = frozenset({"subprocess", "Popen", "run_cli", "grpo"})
_PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "torch.distributed.run")


def _in_tests(obj) -> bool:
    """Whether obj is a function or class defined in a file of tests/."""
    if inspect.isclass(obj):
        path = getattr(sys.modules.get(obj.__module__), "__file__", None)
    elif callable(obj):
        path = getattr(getattr(inspect.unwrap(obj), "__code__", None), "co_filename", None)
    else:
        path = None
    return path is not None and Path(path).resolve().is_relative_to(TESTS)


def _names(code) -> set[str]:
    """The global and attribute names a code object (and the functions nested in it) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


_STARTS: dict = {}  # id(code) -> whether it can start a process


def _starts_a_process(obj, seen: set | None = None) -> bool:
    """Whether calling obj (a function or class of tests/) can start a process."""
    if inspect.isclass(obj):
        return any(_starts_a_process(f, seen) for f in vars(obj).values() if inspect.isfunction(f))
    code = getattr(inspect.unwrap(obj), "__code__", None)
    if code is None or (seen is not None and id(code) in seen):
        return False  # (a cycle: what the other calls start is decided where it began)
    if id(code) in _STARTS:
        return _STARTS[id(code)]
    top, seen = seen is None, (seen or set()) | {id(code)}
    names, scope = _names(code), getattr(inspect.unwrap(obj), "__globals__", {})
    found = bool(names & _PROCESS_NAMES)
    for name in () if found else sorted(names):
        value = scope.get(name)
        if inspect.ismodule(value):
            if value.__name__ in _PROCESS_MODULES:
                found = True
            elif Path(getattr(value, "__file__", None) or "/").resolve().is_relative_to(TESTS):
                # a helper module (import reliability_helpers as h): the functions named through it
                found = any(
                    _starts_a_process(getattr(value, attr), seen)
                    for attr in names
                    if _in_tests(getattr(value, attr, None))
                )
        elif getattr(value, "__module__", None) in _PROCESS_MODULES:
            found = True
        elif _in_tests(value):
            found = _starts_a_process(value, seen)
        if found:
            break
    if found or top:  # (a negative answer inside a cycle may not be the whole answer)
        _STARTS[id(code)] = found
    return found


def _runs_of(item) -> list:
    """The test function, its fixtures' functions (transitively) and its parametrized callables."""
    fns = [getattr(item, "function", None)]
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in getattr(item, "fixturenames", ()):
        fns += [d.func for d in defs.get(name, ())]
    callspec = getattr(item, "callspec", None)
    fns += [v for v in (callspec.params.values() if callspec else ()) if callable(v)]
    return [f for f in fns if f is not None and _in_tests(f)]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(_starts_a_process(fn) for fn in _runs_of(item)):
            item.add_marker(pytest.mark.slow)


# The guard, in a run of the fast tier (-m "not slow"): while a test not marked slow runs (its
# fixtures' set-up and tear-down included, a module-scoped fixture's too), starting a Python
# interpreter, a console script of this environment or torchrun fails it, naming the command
# (other programs start: a library's `ldconfig -p`, say).
_GUARDED: list = [False]  # whether this run selects with -m "not slow"
_UNMARKED: list = [None]  # the item not marked slow that is running now, or None
_HEAVY = re.compile(r"(^|[\\/\s])(python[\d.]*|grpo-[\w-]+|torchrun)(\s|$)")
_STARTED = pytest.StashKey[list]()
_execute_child = subprocess.Popen._execute_child


def _guarded_execute_child(self, args, *rest, **kw):
    item = _UNMARKED[0]
    cmd = " ".join(map(os.fsdecode, [args] if isinstance(args, (str, bytes, os.PathLike)) else args))
    if item is not None and (_HEAVY.search(cmd) or str(BIN) in cmd):
        message = (
            f"{item.nodeid} starts a process ({cmd[:300]}) but is not marked slow: "
            "conftest.pytest_collection_modifyitems did not see it (a process started by grpo_cli, "
            "or through a helper it cannot follow); mark the test @pytest.mark.slow, or run the "
            "training in-process (grpo_cli.cli.train.train_config)"
        )
        item.stash.setdefault(_STARTED, []).append(message)
        raise RuntimeError(message)
    return _execute_child(self, args, *rest, **kw)


subprocess.Popen._execute_child = _guarded_execute_child


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _UNMARKED[0] = None if item.get_closest_marker("slow") or not _GUARDED[0] else item
    try:
        yield
    finally:
        _UNMARKED[0] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started = item.stash.get(_STARTED, None)
    if started and report.passed and report.when == "call":  # (its RuntimeError was caught)
        report.outcome, report.longrepr = "failed", "\n".join(started)


def pytest_configure(config):
    _GUARDED[0] = bool(re.search(r"\bnot\s+slow\b", config.getoption("markexpr", "") or ""))
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


_FLOAT64_KERNELS: dict = {}


@pytest.fixture(autouse=True)
def float64_kernels(monkeypatch):
    """transformers' Gated DeltaNet kernels (Qwen3.5) compute in float32 whatever the model's dtype:
    in tests they compute in float64 for a float64 model (in float32 for any other), so it is
    float64 throughout (their other float32 casts are per token, the same whatever else shares the
    batch) and the float64 equalities hold to summation order."""
    if "transformers" not in sys.modules:  # (a test file that imports it imports it first)
        return
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as module
    except ImportError:  # (transformers 4.57 has no qwen3_5)
        return
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        if name not in _FLOAT64_KERNELS:
            source = inspect.getsource(getattr(module, name))
            assert source.count("to(torch.float32,") == 1, name  # (the one cast this rewrites)
            namespace = dict(vars(module))
            wide = "to(torch.float64 if initial_dtype == torch.float64 else torch.float32,"
            exec(source.replace("to(torch.float32,", wide), namespace)
            _FLOAT64_KERNELS[name] = namespace[name]
        monkeypatch.setattr(module, name, _FLOAT64_KERNELS[name])
