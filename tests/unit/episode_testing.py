"""Test doubles for episodes: a scripted policy in place of a rollout worker, an async face on an in-process
environment (the real session table, relayrl/env/sessions.py), and a pool over it."""

from __future__ import annotations

import asyncio

from relayrl.env import AsyncLocalEnvironmentClient, LocalEnvironmentClient
from relayrl.episodes.envpool import EnvironmentPool
from relayrl.v1 import common_pb2


def local_pool(env_class, *, timeout_s: float = 5.0, max_sessions: int = 8, **env_kwargs) -> EnvironmentPool:
    """A pool of one in-process server running ``env_class`` (create it inside the event loop)."""
    local = LocalEnvironmentClient(env_class, timeout_s=timeout_s, **env_kwargs)
    return EnvironmentPool(
        ["local"],
        max_sessions=max_sessions,
        timeout_s=timeout_s,
        client_factory=lambda _: AsyncLocalEnvironmentClient(local),
    )


class ScriptedPolicy:
    """Answers turn k with ``texts[k]`` tokenized, plus the end-of-turn token unless ``cut[k]`` (finish "length").
    Records every prompt it was given; logprobs are -(k + 1) / 10 per token, the version 10 + k."""

    def __init__(self, tokenizer, texts: list[str], *, cut: set[int] = frozenset(), worker: str = "w0") -> None:
        self.tokenizer, self.texts, self.cut, self.worker = tokenizer, texts, cut, worker
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def __call__(self, token_ids, max_tokens, affinity=""):
        await asyncio.sleep(0)
        k = len(self.prompts) % len(self.texts)
        self.prompts.append(list(token_ids))
        ids = self.tokenizer(self.texts[k], add_special_tokens=False)["input_ids"]
        if k not in self.cut:
            ids = [*ids, self.tokenizer.eos_token_id]
        length = len(ids) > max_tokens or k in self.cut
        ids = ids[:max_tokens]
        self.sampled.append(ids)
        return common_pb2.Completion(
            token_ids=ids,
            logprobs=[-(k + 1) / 10] * len(ids),
            finish_reason=common_pb2.FINISH_REASON_LENGTH if length else common_pb2.FINISH_REASON_STOP,
            policy_version=10 + k,
            worker_id=self.worker,
        )
