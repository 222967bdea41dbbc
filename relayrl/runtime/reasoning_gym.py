"""The reasoning-gym library (the ``tasks`` extra), imported lazily: whether it is installed, a task's data set, and
the score of a response against a row that ``relayrl/data/gym_tasks.py`` wrote (its ``ENTRY_COLUMN``: JSON of the
task, its config and the library's entry). Shared by the data set (relayrl/data/gym_tasks.py) and the rewards
(relayrl/rewards/libraries.py), which sit side by side a layer above."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

INSTALL = "pip install 'relayrl[tasks]'"
ENTRY_COLUMN = "reasoning_gym"  # the row's column: JSON {"task", "config", "entry"}


def missing_extra(module: str = "reasoning_gym", dist: str = "reasoning-gym") -> str | None:
    """Why ``module`` cannot be used here (a one-line reason naming the ``pip install``), or None."""
    try:
        if importlib.util.find_spec(module) is not None:
            return None
    except (ImportError, ValueError):
        pass
    return f"needs {dist} (the tasks extra): {INSTALL}"


def library_dataset(task: str, config: Mapping[str, Any]) -> Any:
    """``reasoning_gym.create_dataset(task, **config)``; ValueError in one line naming the unknown task or the
    config the task refuses (an unknown key, a failed ``validate``)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = sorted(name for name in DATASETS if task[:4] in name)[:8] or sorted(DATASETS)[:8]
        raise ValueError(f"reasoning-gym has no task {task!r} ({len(DATASETS)} tasks, e.g. {', '.join(close)})")
    try:
        return reasoning_gym.create_dataset(task, **config)
    except (TypeError, AssertionError, ValueError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"task {task!r} refuses its config {dict(config)}: {reason}") from None


@lru_cache(maxsize=64)
def _scorer(task: str, config: str) -> Callable[[str | None, dict], float]:
    return library_dataset(task, json.loads(config)).score_answer


def score(response: str, row: Mapping[str, Any]) -> float:
    """The task's ``score_answer`` of the response's last ``<answer>...</answer>`` (None when it has none: the
    task scores that, usually 0) against the row's entry. ValueError when the row is not a reasoning-gym row."""
    from reasoning_gym.utils import extract_answer

    if ENTRY_COLUMN not in row:
        raise ValueError(
            f"the row has no {ENTRY_COLUMN!r} column: controller.reward.fn reasoning_gym scores rows of "
            "data.path reasoning-gym:<task> only"
        )
    payload = json.loads(row[ENTRY_COLUMN])
    scorer = _scorer(payload["task"], json.dumps(payload["config"], sort_keys=True))
    return float(scorer(extract_answer(response), payload["entry"]))
