"""The class a user subclasses to write an environment: one instance per session (episode).

Each method may be ``def`` or ``async def``. Served by ``relayrl env serve module:Class`` (relayrl/env/server.py),
sync methods run on a thread pool and async ones on one event-loop thread shared by every session of the process
(so an ``async def`` must never block: await subprocesses, sockets and sleeps). A method that raises answers the
call with an error status carrying the message (``relayrl.errors.InvalidArgument("task.x", "...")`` answers
INVALID_ARGUMENT; anything else INTERNAL); the server keeps serving.
"""

from __future__ import annotations

from relayrl.env.types import Reset, Step


class Environment:
    """Subclass and implement ``reset`` and ``step`` (and ``close`` when an early end has a reward).

    ``name`` is what ``Info`` reports (default: the class name). The constructor takes no arguments when served
    by ``relayrl env serve``."""

    name: str = ""

    def reset(self, task: dict, seed: int | None) -> Reset:
        """Start the episode for ``task`` (the dataset row; {} when the caller sent none). ``seed``: the episode's
        seed, shared by a GRPO group's episodes (None: choose one); the same task and seed must give the same
        episode."""
        raise NotImplementedError(f"{type(self).__name__}.reset")

    def step(self, action: dict) -> Step:
        """Answer one policy turn: ``action`` is the assistant message (role "assistant", ``content`` without the
        tool-call markup, ``tool_calls`` with dict ``arguments``)."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def close(self, reason: str) -> float | None:
        """The episode ends. ``reason`` is empty when the environment ended it (done or truncated); otherwise
        relayrl ended it early ("max_turns", "max_total_tokens", "deadline", "aborted", "expired") and the return
        value is the episode's reward as it stands (None: no reward, the episode fails). Release resources here."""
        return None
