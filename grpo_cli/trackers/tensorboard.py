"""TensorBoard (trainer.report_to=[jsonl,tensorboard]): each row's numbers as scalars in
<run>/tensorboard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_cli.errors import UserError, first_line
from grpo_cli.files import write_error
from grpo_cli.plugins import Plugin
from grpo_cli.trackers import Facts, missing_package


class TensorBoard:
    """Each row's numbers as TensorBoard scalars, named as in metrics.jsonl, in `log_dir`."""

    def __init__(self, log_dir: Path, resume_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise UserError(
                f"trainer.report_to includes tensorboard, but it cannot be imported ({first_line(exc)}); "
                "install it with: pip install -e '.[tensorboard]' in grpo-cli's folder, or drop it: "
                "trainer.report_to=[jsonl]."
            ) from exc
        try:
            # A resumed run hides the events logged after its checkpoint, as metrics.jsonl drops those rows.
            self.writer = SummaryWriter(
                log_dir=str(log_dir), purge_step=resume_step + 1 if resume_step else None
            )
        except OSError as exc:
            raise write_error(log_dir, exc) from exc

    def log(self, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=row["step"])
        self.writer.flush()  # readable while the run goes on

    def close(self) -> None:
        self.writer.close()


PLUGIN = Plugin(
    name="tensorboard",
    build=lambda start: TensorBoard(start.run_dir / "tensorboard", start.resume_step),
    check=lambda report_to: [p for p in [missing_package("tensorboard", report_to)] if p],
    # torch.utils.tensorboard is in torch; the tensorboard package is what it needs.
    facts=Facts(package="tensorboard"),
)
