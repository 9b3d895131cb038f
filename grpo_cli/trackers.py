"""Experiment trackers: Weights & Biases (`Wandb`) and Trackio (`Trackio`), for
trainer.report_to=[jsonl,wandb] or [jsonl,trackio].

Each receives the rows the trainer writes to metrics.jsonl and logs every number in a row under the
same name as in metrics.jsonl ("reward", "rewards/accuracy/mean", "eval/accuracy", ...) at the row's
step; lists (histograms) are left to metrics.jsonl. They share the interface of
grpo_cli.metrics.TensorBoard: built once per run, `log(row)` per row, `close()` at the end, plus
`log_samples(step, records)` for a table of completions. The packages are optional extras
(pip install 'grpo-cli[wandb]' / 'grpo-cli[trackio]'), imported only when a tracker is built;
`check_report_to` lets config validation report trainer.report_to's problems (an unknown name, a
missing package, W&B without credentials) before a run starts.
"""

from __future__ import annotations

import json
import os
import secrets
import string
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserError, first_line

WANDB_ID_FILE = "wandb-run-id"
SAMPLES_KEY = "completions"

# report_to name -> (the module to import, what else the install hint should say).
_PACKAGES = {
    "wandb": ("wandb", ""),
    # trackio pulls huggingface-hub>=1.10, which transformers 4.x does not allow.
    "trackio": ("trackio", " (it needs huggingface-hub>=1.10, so transformers 5)"),
    # torch.utils.tensorboard is in torch; the tensorboard package is what it needs.
    "tensorboard": ("tensorboard", ""),
}


def _install_hint(name: str, report_to: list[str] | None = None) -> str:
    kept = [n for n in dict.fromkeys(["jsonl", *(report_to or [])]) if n != name]
    return (
        f"install it with: pip install 'grpo-cli[{name}]'{_PACKAGES[name][1]}, "
        f"or drop it from trainer.report_to (e.g. trainer.report_to=[{','.join(kept)}])."
    )


def missing_package(name: str, report_to: list[str] | None = None) -> str | None:
    """The problem to report when trainer.report_to (the list `report_to`) names `name` (wandb,
    trackio or tensorboard) and its package is not installed; None when it is. Looks the package
    up without importing it."""
    if find_spec(_PACKAGES[name][0]) is not None:
        return None
    problem = f"trainer.report_to includes {name}, but the {name} package is not installed; "
    return problem + _install_hint(name, report_to)


# ----------------------------------------------------------------------------- trainer.report_to
# Checked by config validation before a run starts. Packages are looked up, never imported
# (missing_package): wandb and trackio take seconds to import, and a bad command line is answered
# before anything heavy loads.

REPORTERS = ("jsonl", "tensorboard", "wandb", "trackio")
# WANDB_MODE values in which W&B never contacts its server, so it needs no credentials.
WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")


def check_report_to(report_to: list[str]) -> list[str]:
    """trainer.report_to's problems: unknown names, no jsonl, a missing package, W&B that would
    ask for a login."""
    names = [str(name) for name in report_to]
    shown = f"trainer.report_to=[{','.join(names)}]"
    problems = _unknown_reporters(names, shown) + _jsonl_required(names, shown)
    problems += [
        problem
        for name in ("tensorboard", "wandb", "trackio")
        if name in names and (problem := missing_package(name, names))
    ]
    if "wandb" in names and find_spec("wandb") is not None and not wandb_can_log():
        problems.append(_wandb_login_needed())
    return problems


def _unknown_reporters(names: list[str], shown: str) -> list[str]:
    unknown = [name for name in names if name not in REPORTERS]
    if not unknown:
        return []
    return [
        f"{shown}: unknown {'name' if len(unknown) == 1 else 'names'} {', '.join(unknown)}; the "
        f"valid names are {', '.join(REPORTERS)} (e.g. trainer.report_to=[jsonl,tensorboard])."
    ]


def _jsonl_required(names: list[str], shown: str) -> list[str]:
    if "jsonl" in names:
        return []
    return [
        f"{shown} must include jsonl: metrics.jsonl is what the plots, sweep summaries and "
        "trainer.resume read; e.g. trainer.report_to=[jsonl,tensorboard]."
    ]


def _wandb_login_needed() -> str:
    mode = os.environ.get("WANDB_MODE")
    return (
        "trainer.report_to includes wandb, but no W&B credentials were found (no WANDB_API_KEY, and no "
        f"{_wandb_host()} entry in {_netrc_path()}) and W&B would log online "
        f"({'WANDB_MODE=' + repr(mode) if mode else 'WANDB_MODE is not set'}), so wandb.init would "
        "ask for a login (or fail without a terminal) as the run starts: set WANDB_MODE=offline to "
        "log locally (sync later with `wandb sync <run folder>/wandb/offline-run-*`), or log in with "
        "`wandb login` / WANDB_API_KEY."
    )


def _wandb_host() -> str:
    """The W&B server's host name: api.wandb.ai, or a self-hosted server's ($WANDB_BASE_URL)."""
    from urllib.parse import urlsplit

    return urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"


def _netrc_path() -> str:
    """The netrc file `wandb login` writes the key to: $NETRC, else ~/.netrc."""
    return os.path.expanduser(os.environ.get("NETRC") or "~/.netrc")


def wandb_can_log() -> bool:
    """W&B will start a run without asking for a login: it logs locally (WANDB_MODE offline,
    disabled or dryrun), or it finds credentials where wandb.init looks for them: WANDB_API_KEY,
    WANDB_IDENTITY_TOKEN_FILE, or a netrc entry for its server, which `wandb login` writes. (A key
    kept only in W&B's own settings file is not looked for: the message then names the fix.)"""
    import netrc

    if os.environ.get("WANDB_MODE", "").strip().lower() in WANDB_LOCAL_MODES:
        return True
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        entry = netrc.netrc(_netrc_path()).authenticators(_wandb_host())
    except (OSError, netrc.NetrcParseError):  # no file, unreadable or malformed: no credentials there
        return False
    return bool(entry and entry[2])


def _import_error(name: str, exc: ImportError) -> UserError:
    return UserError(
        f"trainer.report_to includes {name}, but it cannot be imported ({first_line(exc)}); "
        + _install_hint(name)
    )


def _numbers(row: dict[str, Any]) -> dict[str, float | int]:
    """The row's numeric values, by name, without "step" (bool is an int subclass: not a metric)."""
    return {
        key: value
        for key, value in row.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def _cells(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A sample record as table cells: nested dicts flattened ("rewards/accuracy"), other values
    that are not str/number/bool/None (a chat prompt's messages) as JSON text, so each column
    holds one type."""
    cells: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            cells.update(_cells(value, f"{name}/"))
        elif value is None or isinstance(value, (str, int, float, bool)):
            cells[name] = value
        else:
            cells[name] = json.dumps(value, ensure_ascii=False, default=str)
    return cells


def _rows(records: list[dict]) -> tuple[list[str], list[list[Any]]]:
    """Columns (every key, in first-seen order) and rows of a samples table."""
    flat = [_cells(record) for record in records]
    columns = list(dict.fromkeys(key for cells in flat for key in cells))
    return columns, [[cells.get(col) for col in columns] for cells in flat]


def _log_row(run, row: dict[str, Any]) -> None:
    """A metrics row's numbers to a W&B or Trackio run (both take run.log(dict, step=))."""
    metrics = _numbers(row)
    if metrics:
        run.log(metrics, step=int(row["step"]))


def _log_table(run, table, step: int, records: list[dict]) -> None:
    """Sample records as a `table` (wandb.Table or trackio.Table: one row per record, a column
    per key) named "completions" at `step`."""
    if records:
        columns, rows = _rows(records)
        run.log({SAMPLES_KEY: table(columns=columns, data=rows)}, step=step)


def _new_wandb_id() -> str:
    # W&B's own form (8 lowercase letters and digits); wandb.util no longer exports generate_id.
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class Wandb:
    """A W&B run in the project $WANDB_PROJECT (default grpo-cli), files under `run_dir`/wandb.

    The run id is kept in `run_dir`/wandb-run-id, so trainer.resume=auto continues the same W&B
    run. A fresh start (resume_step=0) takes a new id even when the file exists: W&B ignores steps
    lower than the ones a run already has, so reusing the old run would drop the new run's rows.
    On resume W&B keeps what it has for the steps past the checkpoint and ignores them when they
    are logged again (it warns). Offline logging: WANDB_MODE=offline, as W&B documents it.
    """

    def __init__(self, run_dir: Path, *, run_name: str, config: dict, resume_step: int = 0):
        try:
            import wandb
        except ImportError as exc:
            raise _import_error("wandb", exc) from exc
        self._wandb = wandb
        id_file = Path(run_dir) / WANDB_ID_FILE
        try:
            run_id = id_file.read_text().strip() if resume_step and id_file.exists() else ""
            if not run_id:
                run_id = _new_wandb_id()
                id_file.write_text(run_id + "\n")
        except OSError as exc:
            raise UserError(f"could not write {id_file}: {first_line(exc)}.") from exc
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "grpo-cli"),
                name=run_name,
                dir=str(run_dir),
                config=config,
                id=run_id,
                resume="allow",
            )
        except Exception as exc:  # wandb.errors.UsageError (no API key), CommError (no network), ...
            raise UserError(
                f"W&B could not start a run ({first_line(exc)}). Without W&B credentials or a network, "
                "log offline with WANDB_MODE=offline (upload later: wandb sync <run folder>/wandb/offline-run-*), "
                "or log in with: wandb login; or drop wandb from trainer.report_to."
            ) from exc

    def log(self, row: dict[str, Any]) -> None:
        _log_row(self.run, row)

    def log_samples(self, step: int, records: list[dict]) -> None:
        """A table of completions named "completions". W&B drops it with a warning if `step` is
        below the last step logged."""
        _log_table(self.run, self._wandb.Table, step, records)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    """A Trackio run named `run_name` in the project $TRACKIO_PROJECT (default grpo-cli).

    Trackio writes a local SQLite database under $TRACKIO_DIR (default ~/.cache/huggingface/trackio;
    `trackio show` opens the dashboard); no account is needed unless TRACKIO_SPACE_ID or
    TRACKIO_SERVER_URL is set. Trackio finds a run by name, not by id, so resume_step > 0 continues
    the run of that name and a fresh start makes a new run even if one has the name already. On
    resume, steps past the checkpoint that the run already has are logged a second time (Trackio
    cannot drop them). Trackio prints a few lines on stdout when a run starts and ends (it has no
    quiet option) and, with psutil installed, logs CPU and memory use every 10 s.
    """

    def __init__(self, run_dir: Path, *, run_name: str, config: dict, resume_step: int = 0):
        try:
            import trackio
        except ImportError as exc:
            raise _import_error("trackio", exc) from exc
        self._trackio = trackio
        try:
            self.run = trackio.init(
                project=os.environ.get("TRACKIO_PROJECT", "grpo-cli"),
                name=run_name,
                config=config,
                resume="allow" if resume_step else "never",
            )
        except Exception as exc:  # a bad project name, a Space without a Hugging Face login, ...
            raise UserError(
                f"Trackio could not start a run ({first_line(exc)}). It logs to $TRACKIO_DIR "
                "(default ~/.cache/huggingface/trackio) unless TRACKIO_SPACE_ID or TRACKIO_SERVER_URL "
                "is set; check those, or drop trackio from trainer.report_to."
            ) from exc

    def log(self, row: dict[str, Any]) -> None:
        _log_row(self.run, row)

    def log_samples(self, step: int, records: list[dict]) -> None:
        """A table of completions named "completions"."""
        _log_table(self.run, self._trackio.Table, step, records)

    def close(self) -> None:
        # trackio.finish() also forgets the current run; Run.finish() alone leaves it to be finished
        # (and announced) again by the next trackio.init and by trackio's exit hook.
        try:
            self._trackio.finish()
        except RuntimeError:  # no current run here (closed from another thread than the one that began it)
            self.run.finish()
