"""Which examples each SFT optimizer step trains on, and how they pack into rows: a pure function of the example
lengths and the config, so a resumed run replays the same steps from its checkpoint's step.

- Order: each epoch visits every example once, shuffled by ``random.Random(f"{seed}/{epoch}")`` (or in file order).
- Steps (gradient accumulation to a token budget): examples join a step in order while the step's tokens stay
  within ``batch_tokens``; an example that does not fit starts the next step, and one longer than the budget is a
  step of its own. A step never spans two epochs. The run is ``epochs`` passes, or with ``steps`` the first
  ``steps`` steps of as many passes as that takes.
- Rows: a step's examples packed first-fit by decreasing length into rows of at most ``pack_tokens`` tokens (one
  forward and backward each; an example longer than ``pack_tokens`` is a row of its own).
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def epoch_order(count: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The example indices of pass ``epoch`` (0-based)."""
    order = list(range(count))
    if shuffle:
        random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


def epoch_steps(lengths: Sequence[int], order: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """``order`` cut into steps of at most ``batch_tokens`` tokens each (module docstring)."""
    steps: list[list[int]] = []
    current, tokens = [], 0
    for index in order:
        if current and tokens + lengths[index] > batch_tokens:
            steps.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += lengths[index]
    if current:
        steps.append(current)
    return steps


def plan_steps(
    lengths: Sequence[int], *, batch_tokens: int, epochs: int, steps: int | None, seed: int, shuffle: bool
) -> list[tuple[int, list[int]]]:
    """(epoch, example indices) of every optimizer step of the run (module docstring)."""
    if not lengths:
        raise ValueError("lengths: no examples to plan steps over")
    plan: list[tuple[int, list[int]]] = []
    epoch = 0
    while (steps is None and epoch < epochs) or (steps is not None and len(plan) < steps):
        order = epoch_order(len(lengths), seed, epoch, shuffle)
        plan += [(epoch, step) for step in epoch_steps(lengths, order, batch_tokens)]
        epoch += 1
    return plan if steps is None else plan[:steps]


def pack_rows(lengths: Sequence[int], examples: Sequence[int], pack_tokens: int) -> list[list[int]]:
    """``examples`` (indices into ``lengths``) packed first-fit by decreasing length into rows of at most
    ``pack_tokens`` tokens; ties keep their order."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(examples, key=lambda i: -lengths[i]):
        at = next((r for r, left in enumerate(room) if lengths[index] <= left), None)
        if at is None:
            rows.append([index])
            room.append(pack_tokens - lengths[index])
        else:
            rows[at].append(index)
            room[at] -= lengths[index]
    return rows
