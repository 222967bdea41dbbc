"""Reward functions: registered by name or imported as ``module:function``, in any of three forms (per response
with keyword arguments, batched per group, or the original ``fn(response, answer) -> float``), sync or async.

``resolve_reward("exact_match")`` takes a registered name; ``resolve_reward("pkg.mod:function")`` imports any
user function. ``check_reward(cfg.controller.reward)`` is the start-up check: the function resolves and its
signature fits a form (``relayrl.rewards.signature``); ``RewardCaller`` calls it on a group and checks what it
returns (``relayrl.rewards.call``).
"""

from relayrl.rewards.builtin import REWARDS, RewardFn, resolve_reward
from relayrl.rewards.call import (
    GroupInputs,
    RewardCaller,
    RewardFailures,
    RewardRaised,
    RewardShapeError,
    check_reward,
    load_reward,
)
from relayrl.rewards.signature import BATCH_ARGS, SAMPLE_ARGS, RewardSignature, reward_signature

__all__ = [
    "BATCH_ARGS",
    "REWARDS",
    "SAMPLE_ARGS",
    "GroupInputs",
    "RewardCaller",
    "RewardFailures",
    "RewardFn",
    "RewardRaised",
    "RewardShapeError",
    "RewardSignature",
    "check_reward",
    "load_reward",
    "resolve_reward",
    "reward_signature",
]

from relayrl.rewards import code, libraries  # noqa: F401 (registers code_tests, reasoning_gym and math_verify)
