"""Optional mirrors of the per-step metrics record: TensorBoard event files and Weights & Biases.

metrics.jsonl stays the source of truth; these receive its numeric fields, keyed by trainer step.
``trainer.tensorboard: true`` writes ``<run dir>/tensorboard``; ``trainer.wandb: {project, mode}``
logs to W&B when the ``wandb`` package is installed and is skipped with a warning otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

from relayrl.config import RelayConfig

log = logging.getLogger(__name__)
SKIPPED_KEYS = frozenset({"step", "time"})


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields (booleans and strings left out), minus the step and the timestamp."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in SKIPPED_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class StepTrackers:
    """Fans one record per step out to the configured trackers (none by default)."""

    def __init__(self, tensorboard=None, wandb_run=None) -> None:
        self._tensorboard = tensorboard
        self._wandb = wandb_run

    @classmethod
    def from_config(cls, cfg: RelayConfig) -> StepTrackers:
        tensorboard = wandb_run = None
        if cfg.trainer.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.warning("trainer.tensorboard is set but the tensorboard package is not installed: skipped")
            else:
                tensorboard = SummaryWriter(log_dir=str(cfg.run_dir / "tensorboard"), flush_secs=10)
        if cfg.trainer.wandb is not None:
            try:
                import wandb
            except ImportError:
                log.warning("trainer.wandb is set but the wandb package is not installed: skipped")
            else:
                wcfg = cfg.trainer.wandb
                wandb_run = wandb.init(
                    project=wcfg.project,
                    entity=wcfg.entity,
                    name=wcfg.name or cfg.run.name,
                    mode=wcfg.mode,
                    dir=str(cfg.run_dir),
                    config=cfg.model_dump(mode="json"),
                )
        return cls(tensorboard, wandb_run)

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(values, step=record["step"])

    def log_eval(self, record: dict, step: int) -> None:
        """An eval line as ``eval/<set>/<metric>``: TensorBoard at the version it measured, W&B at the trainer's
        ``step`` (its steps only increase) with the version as ``eval/<set>/policy_version``."""
        prefix = f"eval/{record['eval']}/"
        values = {prefix + key: value for key, value in scalars(record).items()}
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def log_samples(self, records: list[dict], step: int) -> None:
        """A step's readable samples: TensorBoard text (one markdown table) and a W&B table."""
        rows = [
            [r["prompt"], s["response"], s["reward"], s.get("advantage", 0.0), s["finish_reason"]]
            for r in records
            for s in r["samples"]
        ]
        if self._tensorboard is not None:
            table = ["| prompt | response | reward | advantage | finish |", "|---|---|---|---|---|"]
            table += [f"| {_cell(p)} | {_cell(t)} | {w:.3f} | {a:.3f} | {f} |" for p, t, w, a, f in rows]
            self._tensorboard.add_text("samples", "\n".join(table), step)
        if self._wandb is not None:
            import wandb

            columns = ["prompt", "response", "reward", "advantage", "finish_reason"]
            self._wandb.log({"samples": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def _cell(text: str) -> str:
    """Text as one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>")
