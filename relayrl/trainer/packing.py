"""Padding-free forward passes (``trainer.padding_free``): a right-padded batch's rows packed into micro-batches.

A micro-batch is one sequence [1, T] holding whole rows back to back, ``T <= token_budget`` (a row longer than
the budget gets a micro-batch of its own). Position ids restart at 0 for every row, and the forward gets them with
no attention mask and no cache: transformers then finds the row boundaries from the position ids
(``transformers/masking_utils.py``, ``find_packed_sequence_indices``: a new row wherever the position does not
grow by one) and builds a block-diagonal causal mask, so attention never crosses rows (verl's remove-padding,
OpenRLHF's packing).

Logits are scored only where row token t predicts row token t+1 (never across a boundary), and scattered back to
the padded [B, L-1] layout the loss uses: ``out[i, t]`` scores token t+1 of row i as the padded forward does (up to
float rounding), 0 where row i has no token t+1. The scatter is differentiable, so one backward through the loss
reaches every micro-batch's forward.

Cost: a padded batch computes ``B x L`` positions, a packed one ``sum(len_i)``; attention within a micro-batch is
``T^2`` under the block mask, which ``token_budget`` bounds.
"""

from __future__ import annotations

import logging
from itertools import accumulate

import torch

from relayrl.trainer.algorithms.logprobs import entropy_from_logits, logprobs_from_logits

log = logging.getLogger(__name__)

# trainer.padding_free "auto" packs a forward whose padding is at least this share of its positions: below it the
# saved positions do not pay for the extra, smaller forwards and the block masks.
AUTO_MIN_PADDING_SHARE = 0.25


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Row indices per micro-batch: rows in order, a new micro-batch whenever the next row would take the current
    one past ``token_budget`` tokens (a longer row goes alone). Every row appears exactly once."""
    if token_budget < 1:
        raise ValueError(f"token_budget: must be >= 1, got {token_budget}")
    batches: list[list[int]] = []
    used = token_budget  # the first row opens a micro-batch
    for row, length in enumerate(lengths):
        if used + length > token_budget:
            batches.append([])
            used = 0
        batches[-1].append(row)
        used += length
    return batches


def packed_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    *,
    device: torch.device,
    token_budget: int,
    min_forwards: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of the next token, entropy), both [B, L-1] on ``device``, of the right-padded rows
    ``input_ids`` / ``attention_mask`` [B, L], forwarded packed (module docstring); 0 past each row's end.

    ``min_forwards``: forwards to make at least; the missing ones forward one token whose result enters the output
    times zero (FSDP ranks must all make the same forward and backward calls)."""
    rows, width = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    logprob = torch.zeros(rows, width - 1, device=device)
    entropy = torch.zeros(rows, width - 1, device=device)
    batches = micro_batches(lengths, token_budget)
    for batch in batches:
        tokens = torch.cat([input_ids[i, : lengths[i]] for i in batch]).to(device)
        positions = torch.cat([torch.arange(lengths[i]) for i in batch]).to(device)
        logits = model(input_ids=tokens[None], position_ids=positions[None], use_cache=False).logits[0]
        starts = [0, *accumulate(lengths[i] for i in batch)][:-1]
        # packed position p scores token p + 1 where both belong to one row: every position but a row's last
        scored = torch.cat([s + torch.arange(lengths[i] - 1) for s, i in zip(starts, batch)]).to(device)
        at = (
            torch.cat([torch.full((lengths[i] - 1,), i) for i in batch]).to(device),
            torch.cat([torch.arange(lengths[i] - 1) for i in batch]).to(device),
        )
        picked = logits[scored]
        logprob = logprob.index_put(at, logprobs_from_logits(picked, tokens[scored + 1], temperature))
        entropy = entropy.index_put(at, entropy_from_logits(picked, temperature))
    for _ in range(min_forwards - len(batches)):
        one = torch.zeros(1, 1, dtype=torch.long, device=device)
        logprob = logprob + 0.0 * model(input_ids=one, position_ids=one, use_cache=False).logits.sum()
    return logprob, entropy


class PaddingFree:
    """``trainer.padding_free`` for one backend: whether each forward packs, and what the forwards computed.

    ``mode`` "on" packs every forward, "off" none, "auto" those whose padding share (1 - tokens / positions of
    the padded layout) reaches ``AUTO_MIN_PADDING_SHARE``; ``available`` False (with its ``reason``): never.
    The first decision of each kind (packed, padded) is logged with the padding share that made it."""

    def __init__(self, mode: str, token_budget: int, *, available: bool = True, reason: str = "") -> None:
        self.mode, self.token_budget, self.available, self.reason = mode, token_budget, available, reason
        self._logged: set[bool] = set()
        # since the last take(): positions computed, real tokens, forwards, packed forwards
        self.counts = torch.zeros(4, dtype=torch.float64)

    def decide(self, tokens: int, positions: int) -> bool:
        """Whether a forward of ``tokens`` real tokens in a padded layout of ``positions`` packs."""
        share = 1.0 - tokens / max(positions, 1)
        pack = self.available and (self.mode == "on" or (self.mode == "auto" and share >= AUTO_MIN_PADDING_SHARE))
        if pack not in self._logged:
            why = self.reason if not self.available else f"padding share {share:.2f}"
            if self.mode == "auto" and self.available:
                why += f", auto packs from {AUTO_MIN_PADDING_SHARE:.2f}"
            log.info("trainer.padding_free=%s: %s (%s)", self.mode, "packed rows" if pack else "padded rows", why)
            self._logged.add(pack)
        return pack

    def record(self, tokens: int, positions: int, packed: bool) -> None:
        """A forward that computed ``positions`` positions for ``tokens`` real tokens."""
        self.counts += torch.tensor([positions, tokens, 1, float(packed)], dtype=torch.float64)

    def take(self) -> torch.Tensor:
        """The counts since the last call (then zeroed): [positions computed, real tokens, forwards, packed]."""
        counts, self.counts = self.counts, torch.zeros(4, dtype=torch.float64)
        return counts
