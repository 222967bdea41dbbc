"""What an environment returns and how a failed environment call is reported (``relayrl.env``'s value types)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc


@dataclass
class Reset:
    """The opening of an episode: chat messages (system, user, ...) and the tools offered.

    Messages and tools are OpenAI / Hugging Face chat-template dicts (relayrl/env/messages.py)."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)


@dataclass
class Step:
    """What answers one policy turn.

    ``observations``: tool results (role "tool", one per call, in call order) and/or a user message.
    ``reward``: with ``done`` or ``truncated`` the episode's reward (None: "no reward", the episode fails);
    before that this turn's reward, kept as a metric only (None: 0).
    ``done``: the episode reached its end; ``truncated``: the environment cut it short (its own limit).
    ``metrics``: per-turn numbers, averaged into the run's metrics as ``env/<name>``."""

    observations: list[dict]
    reward: float | None = None
    done: bool = False
    truncated: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class EnvError(Exception):
    """An environment call failed: ``code`` is its gRPC status (None: it failed before any call, e.g. a response
    that does not convert), ``reason`` the server's details, ``deadline`` True when the call ran past its deadline."""

    def __init__(self, code: grpc.StatusCode | None, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"{code.name}: {reason}" if code is not None else reason)

    @property
    def deadline(self) -> bool:
        return self.code == grpc.StatusCode.DEADLINE_EXCEEDED
