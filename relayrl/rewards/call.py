"""Calling a reward function on one group of responses, in any of its forms (``relayrl.rewards.signature``), and
checking what it returns: one finite float per response, else ``RewardShapeError`` naming the function and the
shape it returned."""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from relayrl.config import RewardConfig
from relayrl.rewards.builtin import resolve_reward
from relayrl.rewards.signature import Form, RewardSignature, reward_signature


class RewardShapeError(ValueError):
    """A reward function returned something other than one finite float per response: a bug that would repeat,
    so the run stops with this message rather than train on a guess."""


class RewardRaised(RuntimeError):
    """A reward function raised: its group has no reward (the controller fails that prompt with this reason)."""


class RewardFailures(RuntimeError):
    """More of a step's prompts failed their reward function than ``controller.reward.max_failed_share`` allows:
    the run stops with the first error's message and ``traceback`` (text), since the next step would fail alike."""

    def __init__(self, message: str, traceback: str) -> None:
        super().__init__(message)
        self.traceback = traceback


@dataclass
class GroupInputs:
    """One prompt's group: what a reward function may ask for, one list entry per response.

    ``row``: the dataset row (every column), the same for the whole group; ``conversations``: each response's
    chat messages (role/content dicts) from the opening prompt to its last turn; ``env_rewards``: each
    episode's reward from its environment (None without an environment)."""

    responses: list[str]
    answer: str
    prompt: str
    row: Mapping[str, Any]
    conversations: list[list[dict]]
    env_rewards: list[float] | list[None]

    def sample(self, i: int) -> dict[str, Any]:
        """The per-response keyword arguments of response ``i``."""
        return {
            "response": self.responses[i],
            "answer": self.answer,
            "prompt": self.prompt,
            "row": self.row,
            "conversation": self.conversations[i],
            "env_reward": self.env_rewards[i],
        }

    def batch(self) -> dict[str, list]:
        """The batched keyword arguments: a list per name, one entry per response."""
        n = len(self.responses)
        return {
            "responses": self.responses,
            "answers": [self.answer] * n,
            "prompts": [self.prompt] * n,
            "rows": [self.row] * n,
            "conversations": self.conversations,
            "env_rewards": self.env_rewards,
        }


def describe(value: Any) -> str:
    """A value's type and shape for an error message: 'float', 'list of 7', 'ndarray of shape (8, 1)'."""
    if hasattr(value, "shape"):
        return f"{type(value).__name__} of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)


class RewardCaller:
    """``caller(group) -> list[float]``: the function's value for each response of a group.

    Per-response forms are called once per response (async ones concurrently), batched ones once. Async
    functions run on one event loop thread of this caller, so they may share clients across calls."""

    def __init__(self, fn: Callable, name: str, signature: RewardSignature) -> None:
        self.fn = fn
        self.name = name
        self.signature = signature
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def __call__(self, group: GroupInputs) -> list[float]:
        n = len(group.responses)
        try:
            if self.signature.batched:
                values = self._settle([self.fn(**self._pick(group.batch()))])[0]
            else:
                values = self._settle([self._one(group, i) for i in range(n)])
        except Exception as err:
            raise RewardRaised(f"reward function {self.name!r} raised {type(err).__name__}: {err}") from err
        return self._check(values, n)

    def _pick(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return {k: arguments[k] for k in self.signature.keywords or ()}

    def _one(self, group: GroupInputs, i: int) -> Any:
        if self.signature.keywords is None:
            return self.fn(group.responses[i], group.answer)
        return self.fn(**self._pick(group.sample(i)))

    def _settle(self, values: list[Any]) -> list[Any]:
        """``values`` with their awaitables awaited together on this caller's loop thread (started on first use);
        blocks the calling thread only."""
        if not any(inspect.isawaitable(v) for v in values):
            return values

        async def gather() -> list[Any]:
            return list(await asyncio.gather(*(v if inspect.isawaitable(v) else asyncio.sleep(0, v) for v in values)))

        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="reward-loop", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(gather(), self._loop).result()

    def _check(self, values: Any, n: int) -> list[float]:
        """One finite float per response, else RewardShapeError naming the function, the form and the shape."""
        form = "batched" if self.signature.batched else "per-response"
        if self.signature.batched:
            shape = describe(values)
            if hasattr(values, "shape") and tuple(values.shape) == (n,):  # numpy, torch
                values = values.tolist()
            if not isinstance(values, (list, tuple)) or len(values) != n:
                raise RewardShapeError(
                    f"reward function {self.name!r} ({form}) returned {shape} for a group of {n} responses; "
                    f"it must return a list of {n} finite floats, one per response"
                )
        for i, value in enumerate(values):
            if not _finite(value):
                raise RewardShapeError(
                    f"reward function {self.name!r} ({form}) returned {value!r} ({describe(value)}) for response "
                    f"{i} of {n}; a reward is a finite float"
                )
        return [float(v) for v in values]


def load_reward(spec: str, form: Form = "auto") -> RewardCaller:
    """The caller of a registered name or ``module:function``: KeyError for an unknown name, ValueError naming
    ``spec`` when it cannot be imported or its signature fits no form."""
    fn = resolve_reward(spec)
    return RewardCaller(fn, spec, reward_signature(fn, spec, form))


def check_reward(cfg: RewardConfig) -> RewardCaller:
    """The start-up check of ``controller.reward``: its function resolves and has a form. ValueError starting
    with ``controller.reward.fn``."""
    try:
        return load_reward(cfg.fn, cfg.form)
    except (KeyError, ValueError) as err:
        raise ValueError(f"controller.reward.fn: {err.args[0]}") from None
