"""DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2): over-sample and drop prompt groups whose
responses all got the same reward (their group-relative advantage is 0, so they give no gradient), until
the training batch holds ``target_groups`` informative groups. Plain Python, generic over the group type.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Generic, TypeVar

G = TypeVar("G")


class DynamicSamplingExhausted(RuntimeError):
    """``max_gen_batches`` generation batches did not yield ``target_groups`` informative groups."""

    def __init__(self, kept: int, target: int, gen_batches: int, max_gen_batches: int, dropped: int) -> None:
        self.kept = kept
        self.target = target
        self.gen_batches = gen_batches
        self.max_gen_batches = max_gen_batches
        self.dropped = dropped
        super().__init__(
            f"dynamic sampling exhausted: kept {kept} of {target} target groups after {gen_batches} "
            f"generation batches (max_gen_batches={max_gen_batches}); {dropped} groups were dropped because "
            "all their rewards were equal. Raise max_gen_batches, enlarge the generation batch, or check the "
            "reward function (it may give every response of a prompt the same score)."
        )


def group_is_informative(rewards: Sequence[float], tol: float = 0.0) -> bool:
    """True when the group's rewards are not all equal: max(r) - min(r) > tol.

    An empty or single-response group is not informative. NaN rewards raise ValueError.
    """
    if not tol >= 0:
        raise ValueError(f"tol: must be >= 0, got {tol}")
    values = [float(r) for r in rewards]
    if any(math.isnan(v) for v in values):
        raise ValueError(f"rewards: contains NaN: {values}")
    if len(values) < 2:
        return False
    return max(values) - min(values) > tol


class GroupFiller(Generic[G]):
    """Collects informative groups across generation batches until ``target_groups`` are kept.

    Use one filler per training step::

        filler = GroupFiller(target_groups=32, max_gen_batches=4)
        while not filler.is_full:
            groups, rewards = generate_and_score()
            filler.add_batch(groups, rewards)   # raises DynamicSamplingExhausted when out of batches
        batch = filler.take()                   # exactly 32 groups; the rest is in filler.surplus

    With ``enabled=False`` every group is kept (dynamic sampling off), but the batch limit still applies.
    """

    def __init__(self, target_groups: int, max_gen_batches: int, enabled: bool = True, *, tol: float = 0.0) -> None:
        if isinstance(target_groups, bool) or not isinstance(target_groups, int) or target_groups <= 0:
            raise ValueError(f"target_groups: must be a positive int, got {target_groups!r}")
        if isinstance(max_gen_batches, bool) or not isinstance(max_gen_batches, int) or max_gen_batches <= 0:
            raise ValueError(f"max_gen_batches: must be a positive int, got {max_gen_batches!r}")
        if not tol >= 0:
            raise ValueError(f"tol: must be >= 0, got {tol}")
        self.target_groups = target_groups
        self.max_gen_batches = max_gen_batches
        self.enabled = bool(enabled)
        self.tol = float(tol)
        self._kept: list[G] = []
        self._surplus: list[G] = []
        self._dropped = 0
        self._gen_batches = 0

    @property
    def kept(self) -> list[G]:
        """Groups kept so far (a copy), in arrival order; empty after ``take``."""
        return list(self._kept)

    @property
    def surplus(self) -> list[G]:
        """Kept groups beyond ``target_groups`` that ``take`` did not return (a copy)."""
        return list(self._surplus)

    @property
    def dropped_count(self) -> int:
        """Groups dropped so far because all their rewards were equal."""
        return self._dropped

    @property
    def gen_batches(self) -> int:
        """Generation batches added so far."""
        return self._gen_batches

    @property
    def is_full(self) -> bool:
        """At least ``target_groups`` groups are kept."""
        return len(self._kept) >= self.target_groups

    def add_batch(self, groups: Sequence[G], rewards: Sequence[Sequence[float]]) -> list[G]:
        """Count one generation batch, keep its informative groups, return the dropped ones.

        ``rewards[k]`` are the rewards of the responses of ``groups[k]``. Raises DynamicSamplingExhausted
        when this was batch number ``max_gen_batches`` and the batch is still not full (the groups of this
        batch are counted first).
        """
        if len(groups) != len(rewards):
            raise ValueError(f"rewards: expected one reward list per group ({len(groups)}), got {len(rewards)}")
        dropped = [
            group for group, group_rewards in zip(groups, rewards, strict=True) if not self.offer(group, group_rewards)
        ]
        self.close_batch()
        return dropped

    def offer(self, group: G, rewards: Sequence[float]) -> bool:
        """Keep ``group`` if informative (or dynamic sampling is off); True when kept. Groups offered one at a
        time, as they complete, are kept in that order; ``close_batch`` ends their generation batch."""
        if not self.enabled or group_is_informative(rewards, self.tol):
            self._kept.append(group)
            return True
        self._dropped += 1
        return False

    def close_batch(self) -> None:
        """Count one generation batch; raises DynamicSamplingExhausted as ``add_batch`` does."""
        self._gen_batches += 1
        self.check_exhausted()

    def check_exhausted(self) -> None:
        """Raise DynamicSamplingExhausted if all ``max_gen_batches`` batches are used and it is not full."""
        if self._gen_batches >= self.max_gen_batches and not self.is_full:
            raise DynamicSamplingExhausted(
                kept=len(self._kept),
                target=self.target_groups,
                gen_batches=self._gen_batches,
                max_gen_batches=self.max_gen_batches,
                dropped=self._dropped,
            )

    def take(self, *, partial: bool = False) -> list[G]:
        """Return exactly ``target_groups`` kept groups (the first ones); the rest goes to ``surplus``.
        ``partial``: an exhausted filler hands out the fewer groups it kept instead of raising."""
        if not self.is_full and not partial:
            raise RuntimeError(
                f"take: only {len(self._kept)} of {self.target_groups} target groups are kept; "
                "add more generation batches first"
            )
        batch = self._kept[: self.target_groups]
        self._surplus.extend(self._kept[self.target_groups :])
        self._kept = []
        return batch
