"""Build-time pretraining of the tiny chat model on how a guessing game goes, not on how to win it.

The transcripts are real episodes of ``GuessNumber`` (plain-text play, range [1, high]) run by the episode loop
itself (relayrl/episodes/loop.py) against an in-process environment, with a policy that guesses a uniformly random
number in ``number_share`` of its turns and says a filler phrase in the others, whatever the answers were. A
model pretrained on them (cross-entropy on the assistant's tokens only: loss mask 1) knows the turn structure and
ends its turns with ``<|im_end|>``, but chats instead of guessing most of the time and ignores "higher" / "lower":
what reinforcement learning then has to teach it (docs/agentic.md, the example).
"""

from __future__ import annotations

import asyncio
import random

import torch

from relayrl.env import AsyncLocalEnvironmentClient, LocalEnvironmentClient
from relayrl.env.examples.guess import GuessNumber
from relayrl.episodes.envpool import EnvironmentPool
from relayrl.episodes.loop import EpisodeLimits, EpisodeLoop
from relayrl.v1 import common_pb2

FILLERS = ["hmm", "let me think", "maybe", "ok", "I am not sure", "good question", "wait"]


def guess_transcripts(
    tokenizer, *, count: int, seed: int, high: int, number_share: float, max_turns: int
) -> list[tuple[list[int], list[int]]]:
    """``count`` episodes of the random policy (module docstring) as (token ids, loss mask over them)."""
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id

    async def policy(token_ids, max_tokens, affinity=""):
        text = str(rng.randint(1, high)) if rng.random() < number_share else rng.choice(FILLERS)
        ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], eos][:max_tokens]
        return common_pb2.Completion(token_ids=ids, logprobs=[0.0] * len(ids), policy_version=0)

    async def run_all():
        local = LocalEnvironmentClient(GuessNumber)
        pool = EnvironmentPool(
            ["local"], max_sessions=count, timeout_s=60.0, client_factory=lambda _: AsyncLocalEnvironmentClient(local)
        )
        loop = EpisodeLoop(tokenizer, policy, EpisodeLimits(max_turns, 4096, 32))
        task = {"high": high, "tools": False, "max_turns": max_turns}
        try:
            return await asyncio.gather(*(loop.run(pool, f"pretrain-{i}", task, seed + i) for i in range(count)))
        finally:
            await pool.close()

    episodes = asyncio.run(run_all())
    return [(e.prompt_ids + e.response_ids, [0] * len(e.prompt_ids) + list(e.mask)) for e in episodes]


def pretrain(
    model: torch.nn.Module,
    examples: list[tuple[list[int], list[int]]],
    *,
    pad_id: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> float:
    """``steps`` AdamW steps of next-token cross-entropy on the mask-1 tokens of ``batch_size`` random examples;
    returns the last step's loss."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        batch = rng.sample(examples, min(batch_size, len(examples)))
        length = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), length), dtype=torch.long)
        weights = torch.zeros((len(batch), length), dtype=torch.float32)
        for i, (row, mask) in enumerate(batch):
            ids[i, : len(row)] = torch.tensor(row)
            attention[i, : len(row)] = 1
            weights[i, : len(row)] = torch.tensor(mask, dtype=torch.float32)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        ).view(len(batch), -1)
        loss = (per_token * weights[:, 1:]).sum() / weights[:, 1:].sum().clamp(min=1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss.detach())
