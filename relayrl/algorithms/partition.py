"""How a batch's groups split into mini-batches (one optimizer step each). Plain Python: the controller
records the partition in the batch, the trainer follows it."""

from __future__ import annotations


def split_sizes(count: int, parts: int) -> list[int]:
    """``torch.tensor_split``'s sizes for ``count`` items in ``parts``: the first ``count % parts`` get one more."""
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


def minibatch_groups(kept: int, mini_batches: int, *, target: int | None = None) -> list[int]:
    """Groups per mini-batch for a batch of ``kept`` groups.

    A whole batch splits evenly: ``split_sizes(kept, mini_batches)``. A streamed batch (``target``: the groups
    it was planned to hold) follows the plan ``split_sizes(target, mini_batches)``, since its first
    mini-batches are stepped before the batch ends; a partial batch (kept < target) keeps the planned
    mini-batches it filled, then one smaller last mini-batch with the rest (fewer optimizer steps, never an
    empty one).
    """
    if target is None or kept >= target:
        return [size for size in split_sizes(kept, mini_batches) if size]
    sizes, left = [], kept
    for size in split_sizes(target, mini_batches):
        if left == 0:
            break
        sizes.append(min(size, left))
        left -= sizes[-1]
    return sizes
