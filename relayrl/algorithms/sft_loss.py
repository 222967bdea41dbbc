"""Supervised fine-tuning's loss: token cross-entropy over the trained tokens only, and the two batch layouts that
keep it the same number (right-padded rows, or every example packed into one row).

Layout (as the RL trainer's): a batch is ``input_ids`` [R, L]; the model's logits at position t score token t+1,
so the per-token log-probs are ``logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])`` [R, L−1] and
``target_mask`` [R, L−1] says which of them the loss reads: 1 where token t+1 is a trained token of the same
example as token t (TRL's labels ≠ −100), 0 for prompt or template tokens, padding, and the first token of a packed
example (nothing before it in its own example predicts it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from relayrl.algorithms.aggregation import agg_loss, masked_mean


@dataclass(frozen=True)
class SFTBatch:
    """The model's inputs and the loss's mask for a batch of examples.

    ``attention_mask`` is None for a packed batch: the examples are told apart by ``position_ids`` restarting at 0,
    which transformers turns into a block-diagonal causal mask for sdpa and eager attention when the forward has
    no attention mask and no cache (``use_cache=False``; tested on both); transformers' flash-attention path reads
    the same positions as sequence boundaries (not tested here: there is no flash-attention on CPU).
    ``example_ids`` [R, L−1] is the example each target position scores (−1: none), for per-example sums."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    target_mask: torch.Tensor
    example_ids: torch.Tensor


def _check_examples(examples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
    if not examples:
        raise ValueError("examples: expected at least one (token ids, loss mask) example")
    for i, (ids, mask) in enumerate(examples):
        if not ids:
            raise ValueError(f"examples[{i}]: no tokens")
        if len(mask) != len(ids):
            raise ValueError(f"examples[{i}]: loss mask of {len(mask)} for {len(ids)} token ids")


def pad_examples(examples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int) -> SFTBatch:
    """One right-padded row per example: [B, max length]; ``examples`` are (token ids, loss mask aligned to them)."""
    _check_examples(examples)
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    target_mask = torch.zeros((len(examples), width - 1))
    example_ids = torch.full((len(examples), width - 1), -1, dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        n = len(ids)
        input_ids[row, :n] = torch.tensor(ids)
        attention_mask[row, :n] = 1
        target_mask[row, : n - 1] = torch.tensor(mask[1:], dtype=target_mask.dtype)
        example_ids[row, : n - 1] = row
    position_ids = torch.arange(width).expand(len(examples), width).clone()
    return SFTBatch(input_ids, position_ids, attention_mask, target_mask, example_ids)


def pack_examples(examples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> SFTBatch:
    """Every example back to back in one row [1, Σ lengths], no padding; positions restart at 0 per example.

    The last token of an example is followed by the next example's first, and that target is masked: with the
    block-diagonal attention (``SFTBatch``) each kept target then sees exactly its own example's earlier tokens, so
    its log-prob, and the loss, equal the padded layout's."""
    _check_examples(examples)
    ids = [token for example, _ in examples for token in example]
    positions = [p for example, _ in examples for p in range(len(example))]
    target, owner = [], []
    for index, (example, mask) in enumerate(examples):
        target += [0.0] if index else []  # the previous example's last position would predict this first token
        owner += [-1] if index else []
        target += [float(bit) for bit in mask[1:]]
        owner += [index] * (len(example) - 1)
    return SFTBatch(
        input_ids=torch.tensor([ids]),
        position_ids=torch.tensor([positions]),
        attention_mask=None,
        target_mask=torch.tensor([target]),
        example_ids=torch.tensor([owner]),
    )


def sft_loss(logprob: torch.Tensor, target_mask: torch.Tensor, *, num_tokens: float | None = None) -> torch.Tensor:
    """L = −Σ_{r,t} target_mask · logprob / N: the mean negative log-likelihood over every trained token of the
    batch (TRL's SFT loss: transformers' causal-LM loss with labels −100 elsewhere), N = Σ target_mask, or the
    global count a data-parallel or accumulating caller passes as ``num_tokens``.

    A long example weighs by its token count, not as one example: the same tokens give the same loss padded or
    packed (``pack_examples``), and the loss of a batch split into pieces is their sum with one global N."""
    return agg_loss(-logprob, target_mask, "token-mean", num_tokens=num_tokens)


def token_accuracy(logits: torch.Tensor, targets: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """TRL's ``mean_token_accuracy``: the share of trained tokens where argmax logits equals the target token.
    ``logits`` [R, L−1, V] and ``targets`` [R, L−1] in the layout of the module docstring."""
    if logits.shape[:-1] != targets.shape or targets.shape != target_mask.shape:
        raise ValueError(
            f"logits / targets / target_mask: expected [R, T, V] / [R, T] / [R, T], got {tuple(logits.shape)} / "
            f"{tuple(targets.shape)} / {tuple(target_mask.shape)}"
        )
    return masked_mean((logits.argmax(-1) == targets).float(), target_mask)
