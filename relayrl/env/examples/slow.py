"""``SlowGuessNumber``: ``GuessNumber`` whose every Reset and Step first waits ``RELAYRL_ENV_DELAY_S`` seconds
(default 0), as a slow simulator, sandbox or remote tool would. The wait is ``asyncio.sleep``: the server's other
sessions go on meanwhile. ``relayrl bench episodes`` serves it with a different delay per server process:

    RELAYRL_ENV_DELAY_S=0.4 relayrl env serve relayrl.env.examples.slow:SlowGuessNumber --port 7001
"""

from __future__ import annotations

import asyncio
import os

from relayrl.env.examples.guess import GuessNumber
from relayrl.env.types import Reset, Step

DELAY_ENV = "RELAYRL_ENV_DELAY_S"


def delay_s() -> float:
    """The delay of this process: ``RELAYRL_ENV_DELAY_S`` seconds, a number >= 0."""
    raw = os.environ.get(DELAY_ENV, "0")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{DELAY_ENV}: not a number: {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"{DELAY_ENV}: must be >= 0, got {raw!r}")
    return value


class SlowGuessNumber(GuessNumber):
    name = "guess-number-slow"

    def __init__(self) -> None:
        self.delay_s = delay_s()

    async def reset(self, task: dict, seed: int | None) -> Reset:
        await asyncio.sleep(self.delay_s)
        return super().reset(task, seed)

    async def step(self, action: dict) -> Step:
        await asyncio.sleep(self.delay_s)
        return super().step(action)
