"""Checkpoint retention (``trainer.save_total_limit``, TRL's ``save_total_limit``): after each save, rank 0 deletes
the oldest complete ``step_N`` checkpoints beyond the newest ``limit``.

Never deleted: the newest complete checkpoint (the one a resume loads, ``latest_checkpoint``), an incomplete one (no
trainer_state.json: a save in progress or cut short, never counted), and the best one (the eval's, ``eval.best``):
anything not named ``step_N``, and the ``step_N`` directory that ``<run dir>/best`` or ``checkpoints/best`` names
(a link to it, a file holding its name, or a directory whose best.json holds its ``step``). A checkpoint is
deleted trainer_state.json first, so a deletion cut short leaves an incomplete checkpoint, never one a resume picks.
A deletion that fails (a busy NFS file, a permission) is logged at WARNING and the run goes on: the save it follows
is good. Its leftover, an incomplete checkpoint older than the newest complete one (no save is in progress there),
is deleted again at the next prune.
"""

from __future__ import annotations

import json
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


def best_checkpoints(checkpoints: Path) -> set[str]:
    """The names of the ``step_N`` directories the best checkpoint names (module docstring)."""
    names = set()
    for best in (checkpoints.parent / BEST, checkpoints / BEST):
        if best.is_symlink():
            names.add(Path(best.readlink()).name)
        elif best.is_file():
            names.add(Path(best.read_text().strip()).name)
        elif (best / "best.json").is_file():
            step = json.loads((best / "best.json").read_text()).get("step")
            if isinstance(step, int):
                names.add(f"step_{step}")
    return names


def prune_checkpoints(checkpoints: Path, limit: int | None) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``limit`` (None: keep all), except those the module docstring
    protects, and the leftovers of deletions that failed; returns the ones deleted (a failure is logged, not
    raised)."""
    if limit is None:
        return []
    complete = complete_checkpoints(checkpoints)
    protected = ({complete[-1].name} if complete else set()) | best_checkpoints(checkpoints)
    beyond = [p for p in complete[: max(0, len(complete) - limit)] if p.name not in protected]
    newest = step_of(complete[-1]) if complete else 0
    leftovers = [
        p for p in checkpoints.glob("step_*")
        if p not in complete and p.name not in protected and (n := step_of(p)) is not None and n < newest
    ]  # fmt: skip
    deleted = [path for path in [*leftovers, *beyond] if _delete(path)]
    if deleted:
        log.info("deleted %d checkpoints beyond trainer.save_total_limit %d: %s", len(deleted), limit,
                 ", ".join(p.name for p in deleted))  # fmt: skip
    return deleted


def _delete(checkpoint: Path) -> bool:
    """Delete ``checkpoint``, trainer_state.json first; False (logged at WARNING) when the filesystem refuses."""
    try:
        (checkpoint / "trainer_state.json").unlink(missing_ok=True)
        shutil.rmtree(checkpoint)
    except OSError as err:
        log.warning("trainer.save_total_limit: could not delete %s (%s); the run goes on, the next save retries "
                    "it", checkpoint, err)  # fmt: skip
        return False
    return True
