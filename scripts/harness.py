"""What the benchmarks share (issue #47): launch a grpo-train run, read its metrics rows, interleave
arms, medians, the machine's fingerprint, and one JSON schema written to one results folder.

A benchmark is `scripts/bench_<name>.py`; run from the repository root as
`bash scripts/run.sh python scripts/bench_<name>.py`, it imports this module as `harness` (the
script's own folder is first on Python's path: no sys.path edits). Its result is
`scripts/results/<name>.json`:

    {"schema": 1, "benchmark": NAME, "created": ISO time, "command": argv, "machine": fingerprint(),
     "rows": [{...one measured case...}], "notes": "..."}

Docs cite the file by that path.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "results"
SCHEMA = 1


def fingerprint() -> dict:
    """What a measurement depends on: the CPU (model, cores, the vector units that change both the
    speed and the floating-point trajectory: AVX-512, AVX512-BF16, AMX) and the library versions."""
    flags, model = set(), platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.processor()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    versions = {}
    for package in ("torch", "transformers"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # noqa: BLE001 - not installed: recorded as such
            versions[package] = None
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "avx512": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": "amx_bf16" in flags,
        "python": platform.python_version(),
        **versions,
    }


def machine_key(fp: dict | None = None) -> str:
    """A short name for a fingerprint: results that must be equal bit for bit compare only within one."""
    fp = fp or fingerprint()
    text = json.dumps({k: fp[k] for k in ("cpu", "avx512", "avx512_bf16", "amx", "torch", "transformers")})
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def launch(
    overrides: Sequence[str], run_dir: Path, *, timeout_s: float | None = None, env: dict | None = None
):
    """One `grpo-train` run in a fresh process, its folder `run_dir`; returns its metrics rows.
    Raises SystemExit with the run's last output lines when it fails."""
    run_dir = Path(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "grpo_cli.cli.train", *overrides, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise SystemExit(f"grpo-train {' '.join(overrides)} failed ({done.returncode}):\n{tail}")
    return rows(run_dir)


def rows(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl rows (training steps and evaluations), in order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_rows(run_dir: Path) -> list[dict]:
    """Only the training steps' rows (those with a loss)."""
    return [r for r in rows(run_dir) if "loss" in r]


def interleave(arms: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, arm) in the order to run them: arms alternate within each repeat, and every other
    repeat reverses them, so a machine that speeds up or slows down over the session favours none."""
    order = []
    for r in range(repeats):
        these = list(arms) if r % 2 == 0 else list(reversed(arms))
        order += [(r, arm) for arm in these]
    return order


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def file_hash(paths: Iterable[Path]) -> str:
    """sha256 over files' bytes, in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def write_result(name: str, result_rows: list[dict], *, notes: str = "", path: Path | None = None) -> Path:
    """The benchmark's JSON (one schema, module docstring) in scripts/results/; returns its path."""
    path = Path(path or RESULTS / f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "schema": SCHEMA,
        "benchmark": name,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "machine": fingerprint(),
        "rows": result_rows,
        "notes": notes,
    }
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def print_table(result_rows: list[dict], columns: Sequence[str]) -> None:
    """The rows as a plain text table, one column per key."""
    cells = [[_cell(r.get(c)) for c in columns] for r in result_rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    for line in itertools.chain([list(columns)], cells):
        print("  ".join(text.ljust(w) for text, w in zip(line, widths)))


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
