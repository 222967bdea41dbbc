"""Built-in rewards from the field's libraries (the ``tasks`` extra, docs/libraries.md): ``reasoning_gym`` (a
reasoning-gym task's own ``score_answer``) and ``math_verify`` (Hugging Face's math-verify, what TRL's and
open-r1's accuracy rewards use)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from relayrl.rewards.builtin import REWARDS
from relayrl.runtime import reasoning_gym as library
from relayrl.runtime.deadline import DeadlinePool

# Per response, math-verify's parse of both texts and its verify: its own defaults give parse and verify 5 s each
MATH_VERIFY_TIMEOUT_S = 10.0
# Worker processes verifying at once: groups are scored on several dispatch threads; more would take CPUs from
# the controller's machine for sympy
MATH_VERIFY_WORKERS = min(4, os.cpu_count() or 1)


# A new worker's first call, before any deadline: math-verify's parsers and sympy are imported and built lazily
WARMUP = (r"\boxed{\frac{1}{2}}", "0.5")


@REWARDS.register("reasoning_gym")
def reasoning_gym(response: str, row: Mapping[str, Any]) -> float:
    """The row's reasoning-gym task's ``score_answer`` of the response's last ``<answer>...</answer>``."""
    return library.score(response, row)


def verify_answer(response: str, answer: str) -> float:
    r"""1.0 when math-verify finds the response's final answer (the last ``\boxed{}``, else its last expression)
    equal to the reference, else 0.0; its own signal timeouts off (``parsing_timeout=None``, ``timeout_seconds=None``:
    they run in the main thread only), the caller's process pool keeps the deadline. ValueError when the reference
    parses to nothing (every response would score 0)."""
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify parses nothing from the reference answer {answer[:80]!r}")
    predicted = parse(response, parsing_timeout=None)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=None))


class MathVerify:
    """``math_verify(response, answer)``: ``verify_answer`` in a worker process, DeadlineExceeded (the group fails
    with that reason) past ``timeout_s``."""

    def __init__(self, *, timeout_s: float = MATH_VERIFY_TIMEOUT_S, workers: int = MATH_VERIFY_WORKERS) -> None:
        self.pool = DeadlinePool(verify_answer, workers=workers, timeout_s=timeout_s, warmup=WARMUP)

    def __call__(self, response: str, answer: str) -> float:
        if missing := library.missing_extra("math_verify", "math-verify"):
            raise RuntimeError(f"controller.reward.fn math_verify {missing}")
        return self.pool(response, answer)


REWARDS.register("math_verify")(MathVerify())
