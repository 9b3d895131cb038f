"""`grpo-train`: compose the config, validate it, build the parts (build.py) and train
(engine.py, where the loop is).

The engine never reads Hydra state: this module reads the run folder once and passes it down,
with the config as the schema's typed dataclasses.

Every way a run can end is a short message and a documented exit status (grpo_cli/errors.py),
never a traceback for bad input: Hydra's own composition errors (bad type, unknown key or
option, an output folder that cannot be created) are caught here too and reworded.

However a run ends, once it has metrics its curves are drawn (metrics.png). In a sweep
(`grpo-train -m`) a failing job does not stop the others (grpo_cli/cli/sweep.py); the sweep ends with
a summary and exits non-zero when a job failed.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from grpo_cli import distributed, memory, plots
from grpo_cli.cli.compose_errors import STDERR as _STDERR
from grpo_cli.cli.compose_errors import explain_compose_error as _explain_compose_error
from grpo_cli.cli.sweep import RunFailed, Sweep
from grpo_cli.config import inert_settings, task, to_typed, unused_settings, validate
from grpo_cli.config.renamed import apply_renames
from grpo_cli.errors import (
    EXIT_DIVERGED,
    EXIT_USER_ERROR,
    Interrupted,
    QuietExit,
    TrainingDiverged,
    UserError,
    first_line,
    report_and_exit,
)
from grpo_cli.files import write_atomic
from grpo_cli.metrics import METRICS_FILE

_task_started = False
_training_started = False
_PREEXISTING: set[Path] = set()
_SWEEP = Sweep()
_NOTED: set[str] = set()  # notes already printed (a sweep's jobs share them)


def save_run_record(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> None:
    """The resolved config and the command-line overrides, next to everything the run writes."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        write_atomic(run_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))
    except OSError as exc:
        raise UserError(
            f"could not write the run record in {run_dir}: {first_line(exc)}. Free disk space or "
            "point hydra.run.dir at a writable disk with room."
        ) from exc


def _discard_if_nothing_trained(run_dir: Path) -> None:
    """Bad input found while building (data, model, rewards): leave no run folder behind."""
    if not (run_dir / METRICS_FILE).exists() and not (run_dir / "checkpoints").exists():
        for name in ("config.yaml", "overrides.yaml"):
            (run_dir / name).unlink(missing_ok=True)
        _remove_if_empty(run_dir)


def _remove_if_empty(run_dir: Path) -> None:
    """Hydra creates the run folder (and its parents) before our task runs; a rejected config
    leaves nothing behind: remove the empty folders from the run folder up, never the working
    dir or a folder above it, nor one that existed before this run."""
    cwd = Path.cwd().resolve()
    path = run_dir.resolve()
    while path != cwd and path not in cwd.parents and path not in _PREEXISTING and path.parent != path:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


def note_preexisting(args: list[str]) -> None:
    """The folders on the way to an explicit hydra.run.dir that exist before Hydra creates the
    rest: those are the user's and are never removed."""
    for arg in args:
        if arg.startswith("hydra.run.dir="):
            path = Path(os.path.abspath(Path(arg.split("=", 1)[1]).expanduser()))
            _PREEXISTING.update(p.resolve() for p in (path, *path.parents) if p.exists())


@hydra.main(version_base="1.3", config_path="pkg://grpo_cli.conf", config_name="config")
def _train(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    sys.stderr.write(_STDERR.release())  # whatever Hydra printed while composing (warnings)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        # One job of a sweep: its failure is recorded and the next job runs (grpo_cli/cli/sweep.py).
        _SWEEP.run_job(
            lambda: run_one(cfg, run_dir, overrides, in_sweep=True),
            sweep_dir=Path(hydra_cfg.sweep.dir),
            run_dir=run_dir,
            overrides=overrides,
            num=hydra_cfg.job.num,
        )
        return
    try:
        run_one(cfg, run_dir, overrides, in_sweep=False)
    except RunFailed as exc:
        report_and_exit(exc.title, exc.problems, code=exc.code)
    except QuietExit as exc:  # another rank reports it
        sys.exit(exc.code)


def train_config(cfg: DictConfig, run_dir: Path, on_start=None, d: distributed.Dist | None = None) -> dict:
    """Build the parts from a composed, validated config and train; the last metrics row ({} when
    the checkpoint to resume already ends the run). What grpo-train runs, and the tests too.
    d: this process's rank in a multi-process run (default: one process)."""
    from rich.console import Console

    from grpo_cli.build import build_training
    from grpo_cli.engine import train

    d = d or distributed.Dist()
    typed = to_typed(cfg)
    console = Console(quiet=typed.trainer.quiet or not d.is_main)
    if not d.enabled:
        parts = build_training(typed, run_dir, console)
    else:  # every rank builds; one failure stops all, reported once
        error = None
        try:
            parts = build_training(typed, run_dir, console, d)
        except Exception as exc:  # noqa: BLE001 - re-raised below, on the rank that reports it
            error = exc
        failed = d.gather(error is not None)
        if any(failed):
            if error is None or d.rank != failed.index(True):
                raise QuietExit(EXIT_USER_ERROR)
            raise error
    if parts is None:
        return {}
    # The saved config says what ran (and what a resume compares with): auto resolved (to_typed).
    cfg.loss.sampler_correction = typed.loss.sampler_correction
    return train(typed, parts, run_dir, OmegaConf.to_yaml(cfg, resolve=True), on_start=on_start)


def run_one(cfg: DictConfig, run_dir: Path, overrides: list[str], *, in_sweep: bool = False) -> dict:
    """Validate, build and train; the last metrics row (rank 0's; {} when a resumed run had
    already ended, or in the launcher of several processes). A failure worded for the user is
    raised as RunFailed. A single run that fails on bad input leaves no files; a sweep job keeps
    its folder for its status. grpo-train and grpo_cli.train (api.py) run here.
    trainer.num_processes > 1: start that many workers (this same command) and wait for them;
    a worker (started by torchrun or by that launcher) joins the others first."""
    d = distributed.from_env()
    # An old key's name, read as the new one; the task's rewards where the user chose none.
    try:
        notes = apply_renames(cfg) + task.apply(cfg, overrides)
    except UserError as exc:  # (a task that declares a reward no one has)
        raise RunFailed("grpo-train: invalid configuration", [str(exc)]) from exc
    for note in notes:
        if d.is_main:
            print(f"grpo-train: note: {note}", file=sys.stderr, flush=True)
    # A sweep job's workers (trainer.num_processes) run as plain runs: the launcher marks them.
    problems = validate(cfg, unused_ok=in_sweep or os.environ.get(_SWEEP_JOB) == "1")
    if in_sweep and d.is_main:  # a setting shared by every job of a sweep may not apply to this one
        for note in unused_settings(cfg):
            print(f"grpo-train: note: {note}", file=sys.stderr, flush=True)
    if d.is_main and not problems:  # a key set (or swept) that cannot change this training
        for note in inert_settings(cfg, [o.lstrip("+").split("=", 1)[0] for o in overrides]):
            if note not in _NOTED:
                _NOTED.add(note)  # (once per sweep, not once per job)
                print(f"grpo-train: note: {note}", file=sys.stderr, flush=True)
    if problems:
        if not d.is_main:  # every rank finds the same problems; rank 0 reports them
            raise QuietExit(EXIT_USER_ERROR)
        if not in_sweep:
            _remove_if_empty(run_dir)
        raise RunFailed("grpo-train: invalid configuration", problems)
    if cfg.trainer.num_processes > 1 and not d.enabled:
        _launch(cfg, run_dir, overrides, in_sweep=in_sweep)
        return {}
    together = False  # every rank ends here alike: finished, or stopped by a signal at the same step
    try:
        if d.enabled:
            run_dir = _join(cfg, d, run_dir)
        row = _run_here(cfg, run_dir, overrides, in_sweep=in_sweep, d=d)
        together = True
        return row
    except SystemExit as exc:
        together = exc.code in (130, 143)
        raise
    except Exception as exc:
        if not d.enabled or isinstance(exc, (RunFailed, QuietExit)):
            raise
        if distributed.is_peer_failure(exc):  # another rank died: its own error says why
            raise QuietExit(1) from exc
        if distributed.is_timeout(exc):
            raise RunFailed(
                f"grpo-train (rank {d.rank})",
                [
                    f"no answer from the other processes within trainer.distributed_timeout_s="
                    f"{cfg.trainer.distributed_timeout_s} s ({first_line(exc, 160)}): a process died, hung or "
                    "is far slower than the others. The run stopped; resume from its last checkpoint "
                    f"(hydra.run.dir={run_dir} trainer.resume=auto)."
                ],
                code=1,
            ) from exc
        raise
    finally:
        distributed.leave(finished=together)


def _join(cfg: DictConfig, d: distributed.Dist, run_dir: Path) -> Path:
    """Join the process group; rank 0 chooses the run folder (each rank's Hydra resolves its own
    `${now:}`), and the others remove the one they created if it differs."""
    from grpo_cli.precision import resolve_device

    try:
        device = resolve_device(cfg.trainer.device)
    except UserError as exc:
        raise RunFailed("grpo-train", [str(exc)]) from exc
    distributed.join(d, device.type, cfg.trainer.distributed_timeout_s)
    chosen = Path(d.broadcast(str(run_dir)))
    if chosen.resolve() != run_dir.resolve():
        _remove_if_empty(run_dir)
    return chosen


def _run_here(cfg: DictConfig, run_dir: Path, overrides: list[str], *, in_sweep: bool, d) -> dict:
    """Build and train in this process (one of several when d.enabled; rank 0 writes the files);
    the last metrics row."""
    started = False
    try:
        # The run record is written once everything is built, right before the first step.
        def on_start() -> None:
            global _training_started
            nonlocal started
            if d.is_main:
                save_run_record(cfg, run_dir, overrides)
            _training_started = started = True

        return train_config(cfg, run_dir, on_start=on_start, d=d)
    except UserError as exc:
        if not in_sweep and d.is_main:
            _discard_if_nothing_trained(run_dir)
        title = f"grpo-train (rank {d.rank})" if d.enabled else "grpo-train"
        raise RunFailed(title, [str(exc)]) from exc
    except TrainingDiverged as exc:
        if not d.is_main:  # every rank stops alike; rank 0 reports
            raise QuietExit(EXIT_DIVERGED) from exc
        raise RunFailed("grpo-train: training stopped", [str(exc)], code=EXIT_DIVERGED) from exc
    except Interrupted:
        if not in_sweep and d.is_main:
            _discard_if_nothing_trained(run_dir)
        raise
    except Exception as exc:
        if not memory.is_out_of_memory(exc):
            raise
        if not in_sweep and d.is_main:
            _discard_if_nothing_trained(run_dir)
        t = cfg.trainer
        raise RunFailed(
            "grpo-train", [memory.out_of_memory_advice(exc, t, cfg.sampler, str(t.device))]
        ) from exc
    finally:  # however a run that trained ended: its curves (a failure here only warns)
        if started and d.is_main:
            plots.draw_safely(plots.draw_run, run_dir, prog="grpo-train")


def _launch(cfg: DictConfig, run_dir: Path, overrides: list[str], *, in_sweep: bool) -> None:
    """trainer.num_processes=N: run this same command in N workers through torchrun's launcher,
    in the run folder chosen here; they print and write (rank 0) as one run would."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    n = cfg.trainer.num_processes
    _check_devices(cfg, n)
    args = _config_flags(sys.argv[1:]) + list(overrides) + [f"hydra.run.dir={run_dir}"]
    if in_sweep:
        os.environ[_SWEEP_JOB] = "1"  # the workers inherit it
    try:
        distributed.launch(_entry_command(), args, n, cfg.trainer.distributed_timeout_s)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if not in_sweep:
            _discard_if_nothing_trained(run_dir)
        code = failure.exitcode if failure.exitcode > 0 else 1
        if code in (130, 143):  # stopped by a signal: the workers said so (and how to resume)
            raise SystemExit(code) from None
        raise RunFailed(
            "grpo-train",
            [
                f"process {rank} of {n} stopped with exit status {failure.exitcode} (its error is above); "
                "the other processes were stopped."
            ],
            code=code,
        ) from None
    except SignalException as exc:  # Ctrl-C: the workers finished their step, saved and said so
        raise SystemExit(128 + int(exc.sigval)) from None
    finally:
        os.environ.pop(_SWEEP_JOB, None)


# Set for the workers of a sweep job with trainer.num_processes > 1 (see _run's validation).
_SWEEP_JOB = "GRPO_SWEEP_JOB"


def _check_devices(cfg: DictConfig, n: int) -> None:
    """One GPU per process: refuse more processes than GPUs before any worker starts."""
    import torch

    from grpo_cli.precision import resolve_device

    try:
        device = resolve_device(cfg.trainer.device)
    except UserError as exc:
        raise RunFailed("grpo-train", [str(exc)]) from exc
    if device.type == "cuda" and n > torch.cuda.device_count():
        raise RunFailed(
            "grpo-train",
            [
                f"trainer.num_processes={n}, but this machine has {torch.cuda.device_count()} GPU(s) and each "
                f"process needs its own; set trainer.num_processes={torch.cuda.device_count()} (or fewer), or "
                "use several machines with torchrun (README: More than one device)."
            ],
        )


def _entry_command() -> list[str]:
    """The command that started this process, without its arguments (a console script, `python
    -m grpo_cli.cli.train`, `python -c ...`): what the workers run."""
    orig = list(getattr(sys, "orig_argv", []))
    n = len(sys.argv) - 1  # the arguments after the program
    if len(orig) > n >= 0:
        return [sys.executable, *orig[1 : len(orig) - n]]
    return [sys.executable, "-m", "grpo_cli.cli.train"]


_CONFIG_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")


def _config_flags(args: list[str]) -> list[str]:
    """Hydra's config-location flags among the arguments, for the workers."""
    out = []
    for i, arg in enumerate(args):
        if arg in _CONFIG_FLAGS and i + 1 < len(args):
            out += [arg, args[i + 1]]
        elif arg.split("=", 1)[0] in _CONFIG_FLAGS and "=" in arg:
            out.append(arg)
    return out


# ----------------------------------------------------------------------------- before the task


def _interrupt(signum, frame) -> None:
    if frame is not None and frame.f_code.co_name == "__del__":
        # A finalizer was running (the garbage collector, e.g. while a launcher stops this rank
        # after another failed): an exception raised there is only printed, as "Exception ignored",
        # with a traceback. Deliver the signal again a moment later, outside it.
        import threading

        threading.Timer(0.01, signal.raise_signal, (signum,)).start()
        return
    raise Interrupted(signal.Signals(signum).name, 128 + signum)


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, signal.SIG_DFL)
        except ValueError:  # not the main thread
            pass


def _print_job_configs(args: list[str]) -> bool:
    """`--cfg job` (also with -m and --resolve): each job's config as grpo-train composes it, the
    task's rewards included (Hydra's own printer shows the defaults list's, and refuses -m).
    False where the arguments do not ask for it; a bad override is one paragraph, exit status 2."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from grpo_cli.cli.common import compose_config

    wanted, rest, config_dir, i = None, [], None, 0
    while i < len(args):
        arg = args[i]
        if arg in ("--cfg", "-c") and i + 1 < len(args):
            wanted, i = args[i + 1], i + 2
            continue
        if arg.startswith("--cfg="):
            wanted = arg.split("=", 1)[1]
        elif arg in ("--config-dir", "-cd") and i + 1 < len(args):
            config_dir, i = args[i + 1], i + 2
            continue
        elif arg.startswith(("--config-dir=", "-cd=")):
            config_dir = arg.split("=", 1)[1]
        elif arg not in ("-m", "--multirun", "--resolve"):
            rest.append(arg)
        i += 1
    if wanted is None:
        return False
    flags = [a for a in rest if a.startswith("-")]
    if wanted != "job" or flags:
        if "-m" in args or "--multirun" in args:
            why = (
                f"--cfg {wanted} prints one config and cannot be combined with -m"
                if wanted != "job"
                else f"grpo-train --cfg job -m prints each job's config, but not with {' '.join(flags)}"
            )
            report_and_exit(
                "grpo-train",
                [f"{why}; drop -m to see one job's config (Hydra prints it)."],
                code=EXIT_USER_ERROR,
            )
        return False  # (Hydra's own printer: --cfg hydra / all, --package, --config-name)
    try:
        parsed = OverridesParser.create().parse_overrides(rest)
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, max_batch_size=None) for job in batch]
        for num, job in enumerate(jobs):
            cfg = compose_config(job, config_dir=config_dir, check=False)
            if len(jobs) > 1:
                print(f"# job {num}: {' '.join(job)}")
            print(OmegaConf.to_yaml(cfg, resolve="--resolve" in args), end="", flush=True)
    except UserError as exc:
        report_and_exit("grpo-train", [str(exc)], code=EXIT_USER_ERROR)
    except (HydraException, OmegaConfBaseException) as exc:  # (a sweep's grammar)
        report_and_exit("grpo-train", [str(exc).strip().splitlines()[0]], code=EXIT_USER_ERROR)
    return True


def main() -> None:
    # Until the engine takes over (it finishes the current step and saves), SIGINT/SIGTERM
    # stop at once: nothing has been trained, so nothing is saved.
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, _interrupt)
        except ValueError:  # not the main thread
            pass
    note_preexisting(sys.argv[1:])
    if _print_job_configs(sys.argv[1:]):
        return
    _STDERR.start()
    try:
        _train()
    except SystemExit as exc:
        captured = _STDERR.release()
        # Hydra reports composition errors (bad type, unknown key or option) and exits 1
        # before our task starts; those are user errors like any other: exit 2.
        if exc.code == 1 and not _task_started:
            print(_explain_compose_error(captured), file=sys.stderr, flush=True)
            sys.exit(2)
        sys.stderr.write(captured)
        _SWEEP.finish(stopped_by=_stop_reason(exc.code))  # a sweep stopped early: summarise the jobs that ran
        raise
    except Interrupted as exc:
        sys.stderr.write(_STDERR.release())
        print(
            f"grpo-train: stopped by {exc.signal_name} "
            + (
                "after training; its checkpoints are kept."
                if _training_started
                else "before training started; nothing was saved."
            ),
            file=sys.stderr,
            flush=True,
        )
        _SWEEP.finish(stopped_by=exc.signal_name)
        sys.exit(exc.exit_code)
    finally:
        sys.stderr.write(_STDERR.release())
        # From here the process only exits: a SIGTERM now (a launcher stopping the other ranks
        # after one failed) ends it by the default action, not by an Interrupted raised inside
        # an atexit callback, which Python would print as a traceback.
        _default_signals()
    code = _SWEEP.finish()  # a sweep: its summary; non-zero when a job failed
    if code:
        sys.exit(code)


def _stop_reason(code) -> str:
    if code in (130, 143):
        return signal.Signals(code - 128).name
    return f"exit status {code}"


if __name__ == "__main__":
    main()
