"""``controller.reward.fn: code_tests``: a response's code run against its row's tests in the sandbox
(relayrl/runtime/sandbox.py); 1.0 when every test passes, else 0.0, each verdict with its reason.

The row carries the problem in its ``code_tests`` column (rows of ``data.path: humaneval`` do; any data set may):
the check program is the HumanEval harness's, ``prompt + completion + "\\n" + test + "\\n" +
f"check({entry_point})"`` (relayrl/runtime/humaneval.py), run in a fresh sandboxed interpreter instead of the
library's forked ``exec``. The completion is the response's first fenced code block (what a chat model answers
with: the whole function, which redefines the prompt's stub), else the response as it is (a base model's
continuation of the stub).

Sandboxes run in this reward's own pool: at most ``workers`` at once on threads that wait on their processes, each
ended at its deadline (``Limits.wall_s``), so a group's responses run side by side and a slow test holds its own
group only, never the controller's other work.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from relayrl.rewards.builtin import REWARDS
from relayrl.runtime.humaneval import check_program, problem_of
from relayrl.runtime.sandbox import Execution, Limits, run_python

# The library's timeout (evaluate_functional_correctness: 3 s per program) plus its join's 1 s grace, which here
# also covers the sandboxed interpreter's start; CPU seconds likewise; memory: address space of one interpreter
CODE_TESTS_LIMITS = Limits(cpu_s=4, memory_mb=1024, wall_s=4.0, output_chars=400)
# Sandboxes at once: each is a CPU-bound interpreter on the controller's machine
CODE_TESTS_WORKERS = min(4, os.cpu_count() or 1)

log = logging.getLogger(__name__)
FENCED = re.compile(r"```[^\n`]*\n(.*?)(?:```|$)", re.DOTALL)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str  # "passed", "timed out" (the library's words), or "failed: " and the error's last line or the limit


def completion_of(response: str) -> str:
    """The response's first fenced code block (its content, without the fences; an unclosed one runs to the
    end), else the response as it is."""
    block = FENCED.search(response)
    return block.group(1) if block else response


def verdict_of(run: Execution) -> Verdict:
    """Passed when the program exited 0; else why not."""
    if run.exit_code == 0:
        return Verdict(True, "passed")
    if run.timed_out:
        return Verdict(False, "timed out")
    if run.limit:
        return Verdict(False, f"failed: {run.limit}")
    last = next((line for line in reversed(run.stderr.splitlines()) if line.strip()), f"exit code {run.exit_code}")
    return Verdict(False, f"failed: {last.strip()}")


class CodeTests:
    """``await code_tests(response=, row=)`` -> 1.0 / 0.0; ``check(problem, completion)``: the verdict with its
    reason, run in the pool's sandbox."""

    def __init__(self, *, limits: Limits = CODE_TESTS_LIMITS, workers: int = CODE_TESTS_WORKERS) -> None:
        self.limits = limits
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="code-tests")

    def check(self, problem: Mapping[str, str], completion: str) -> Verdict:
        """Run the problem's check program on ``completion`` (in the calling thread) and judge it."""
        return verdict_of(run_python(check_program(problem, completion), self.limits))

    async def __call__(self, response: str, row: Mapping[str, Any]) -> float:
        problem = problem_of(row)
        loop = asyncio.get_running_loop()
        verdict = await loop.run_in_executor(self.pool, self.check, problem, completion_of(response))
        log.debug("code_tests %s: %s", problem.get("task_id", "?"), verdict.reason)
        return float(verdict.passed)


REWARDS.register("code_tests")(CodeTests())
