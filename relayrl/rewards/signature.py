"""How a reward function is called, read from its signature (``inspect``) or set by ``controller.reward.form``.

Three forms:

- **per response**, keywords: parameters named from ``SAMPLE_ARGS`` (``response``, ``answer``, ``prompt``,
  ``row``, ``conversation``, ``env_reward``); called once per response, returns one float.
- **batched**, keywords: parameters named from ``BATCH_ARGS`` (the same names in the plural); called once per
  group with a list per name (one entry per response), returns a list of floats of the group's length.
- **positional** ``fn(response, answer)``: any other function that takes two positional arguments (the
  original contract; its parameter names are free).

Either form may be ``async def`` (or return an awaitable). ``relayrl.rewards.check_reward`` is the start-up
check.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

SAMPLE_ARGS = ("response", "answer", "prompt", "row", "conversation", "env_reward")
BATCH_ARGS = tuple(f"{name}s" for name in SAMPLE_ARGS)
Form = Literal["auto", "sample", "batch"]


@dataclass(frozen=True)
class RewardSignature:
    """``batched``: one call per group with lists; ``keywords``: the arguments passed by name (None: positional
    ``fn(response, answer)``). Async needs no mark: an awaitable result is awaited."""

    batched: bool
    keywords: tuple[str, ...] | None

    def wants(self, name: str) -> bool:
        """Whether the function takes the per-response argument ``name`` (or its batched plural)."""
        return bool(self.keywords) and (name in self.keywords or f"{name}s" in self.keywords)


def reward_signature(fn: Callable, name: str, form: Form = "auto") -> RewardSignature:
    """The calling form of ``fn``; ValueError naming ``name`` and its parameters when it fits none.

    "auto": a function whose required parameters all come from ``SAMPLE_ARGS`` (or all from ``BATCH_ARGS``) gets
    those it names, by keyword (parameters with defaults outside the family keep their defaults); any other function
    of two positional arguments is ``fn(response, answer)``. "sample" / "batch" force the keyword form (a
    ``**kwargs`` function gets every argument of it)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise ValueError(
            f"reward function {name!r}: its signature cannot be read; set controller.reward.form"
        ) from None
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = {p.name for p in named if p.default is p.empty}
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    shown = f"{name}({', '.join(str(p) for p in params)})"
    families = {"sample": (False, SAMPLE_ARGS), "batch": (True, BATCH_ARGS)}
    known = {f: tuple(p.name for p in named if p.name in args) for f, (_, args) in families.items()}
    if form == "auto" and known["sample"] and known["batch"]:
        raise ValueError(
            f"reward function {shown} mixes per-response ({', '.join(known['sample'])}) and batched "
            f"({', '.join(known['batch'])}) arguments"
        )
    family = form if form != "auto" else "sample" if known["sample"] else "batch" if known["batch"] else None
    if family is not None:
        batched, allowed = families[family]
        if required <= set(allowed):
            return RewardSignature(batched, allowed if takes_all else known[family])
        if form != "auto" or batched:
            missing = ", ".join(sorted(required - set(allowed)))
            raise ValueError(
                f"reward function {shown}: the {family} form passes {', '.join(allowed)}; none for {missing}"
            )
    try:
        inspect.signature(fn).bind(None, None)
        return RewardSignature(False, None)
    except TypeError:
        raise ValueError(
            f"reward function {shown}: name its parameters from {', '.join(SAMPLE_ARGS)} (one call per response) "
            f"or from {', '.join(BATCH_ARGS)} (one call per group, lists), or take (response, answer) positionally "
            "(a function of **kwargs alone: set controller.reward.form)"
        ) from None
