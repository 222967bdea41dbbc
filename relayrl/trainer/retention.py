"""Checkpoint retention (``trainer.save_total_limit``, TRL's ``save_total_limit``): after each save, rank 0 deletes
the oldest complete ``step_N`` checkpoints beyond the newest ``limit``.

Never deleted: the newest complete checkpoint (the one a resume loads, ``latest_checkpoint``), an incomplete one (no
trainer_state.json: a save in progress or cut short, never counted), and the best one: ``checkpoints/best``
itself, and the ``step_N`` directory it names when it is a link to one or a file holding its name. A checkpoint is
deleted trainer_state.json first, so a deletion cut short leaves an incomplete checkpoint, never one a resume picks.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

BEST = "best"


def step_of(path: Path) -> int | None:
    """N of a ``step_N`` directory name, else None."""
    prefix, _, number = path.name.partition("_")
    return int(number) if prefix == "step" and number.isdigit() else None


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """The complete ``step_N`` checkpoints (trainer_state.json written last), oldest first."""
    found = [p for p in checkpoints.glob("step_*") if step_of(p) is not None and (p / "trainer_state.json").exists()]
    return sorted(found, key=step_of)


def best_checkpoint(checkpoints: Path) -> str | None:
    """The name of the ``step_N`` directory ``checkpoints/best`` names (a link to it, or a file holding its name)."""
    best = checkpoints / BEST
    if best.is_symlink():
        return Path(best.readlink()).name
    if best.is_file():
        return Path(best.read_text().strip()).name
    return None


def prune_checkpoints(checkpoints: Path, limit: int | None) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``limit`` (None: keep all), except those the module docstring
    protects; returns the deleted ones."""
    if limit is None:
        return []
    complete = complete_checkpoints(checkpoints)
    protected = {complete[-1].name} if complete else set()
    if (best := best_checkpoint(checkpoints)) is not None:
        protected.add(best)
    deleted = [p for p in complete[: max(0, len(complete) - limit)] if p.name not in protected]
    for path in deleted:
        (path / "trainer_state.json").unlink()
        shutil.rmtree(path)
    if deleted:
        log.info("deleted %d checkpoints beyond trainer.save_total_limit %d: %s", len(deleted), limit,
                 ", ".join(p.name for p in deleted))  # fmt: skip
    return deleted
