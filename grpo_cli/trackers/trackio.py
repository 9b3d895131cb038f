"""Trackio (trainer.report_to=[jsonl,trackio]): every metrics row logged to a local Trackio run,
a table of completions per logged step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserError, first_line
from grpo_cli.plugins import Plugin
from grpo_cli.trackers import Facts, import_error, log_row, log_table, missing_package


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
            raise import_error("trackio", exc) from exc
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
        log_row(self.run, row)

    def log_samples(self, step: int, records: list[dict]) -> None:
        """A table of completions named "completions"."""
        log_table(self.run, self._trackio.Table, step, records)

    def close(self) -> None:
        # trackio.finish() also forgets the current run; Run.finish() alone leaves it to be finished
        # (and announced) again by the next trackio.init and by trackio's exit hook.
        try:
            self._trackio.finish()
        except RuntimeError:  # no current run here (closed from another thread than the one that began it)
            self.run.finish()


PLUGIN = Plugin(
    name="trackio",
    build=lambda start: Trackio(
        start.run_dir, run_name=start.run_name, config=start.config, resume_step=start.resume_step
    ),
    check=lambda report_to: [p for p in [missing_package("trackio", report_to)] if p],
    # trackio pulls huggingface-hub>=1.10, which transformers 4.x does not allow.
    facts=Facts(
        package="trackio", install_note=" (it needs huggingface-hub>=1.10, so transformers 5)", samples=True
    ),
)
