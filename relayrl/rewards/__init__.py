"""Verifiable reward functions: ``fn(response: str, answer: str) -> float``, looked up by name.

``resolve_reward("exact_match")`` takes a registered name; ``resolve_reward("pkg.mod:function")``
imports any user function with the same signature.
"""

from relayrl.rewards.builtin import REWARDS, RewardFn, resolve_reward

__all__ = ["REWARDS", "RewardFn", "resolve_reward"]
