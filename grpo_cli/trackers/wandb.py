"""Weights & Biases (trainer.report_to=[jsonl,wandb]): every metrics row logged to a W&B run, a
table of completions per logged step; offline with WANDB_MODE=offline."""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserError, first_line
from grpo_cli.plugins import Plugin
from grpo_cli.trackers import Facts, import_error, log_row, log_table, missing_package

WANDB_ID_FILE = "wandb-run-id"
# WANDB_MODE values in which W&B never contacts its server, so it needs no credentials.
WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")


def check(report_to: list[str]) -> list[str]:
    """Its package installed, and credentials where W&B would log online (it would otherwise ask
    for a login as the run starts)."""
    problem = missing_package("wandb", report_to)
    if problem:
        return [problem]
    return [] if wandb_can_log() else [_wandb_login_needed()]


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
            raise import_error("wandb", exc) from exc
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
        log_row(self.run, row)

    def log_samples(self, step: int, records: list[dict]) -> None:
        """A table of completions named "completions". W&B drops it with a warning if `step` is
        below the last step logged."""
        log_table(self.run, self._wandb.Table, step, records)

    def close(self) -> None:
        self.run.finish()


PLUGIN = Plugin(
    name="wandb",
    build=lambda start: Wandb(
        start.run_dir, run_name=start.run_name, config=start.config, resume_step=start.resume_step
    ),
    check=check,
    facts=Facts(package="wandb", samples=True),
)
