"""Padding-free forward passes (``trainer.padding_free``): a right-padded batch's rows forwarded in length buckets.

Rows are sorted longest first and cut into runs, the micro-batches. Each is one [b, L_b] forward of its b rows,
right-padded only to its own longest row ``L_b``, with no attention mask and no cache: causal attention never
looks right, so a row's positions see only that row's earlier tokens and come out as in the padded forward (up to
float rounding), and SDPA runs its causal kernel, ``b x L_b^2 / 2`` of attention (one packed [1, T] sequence under
a block-diagonal mask would pay ``T^2``: a materialised mask, no block skipped).

The cut (``micro_batches``) minimises ``sum_b (b x L_b + FORWARD_COST)``: the positions computed (padding only
up to each micro-batch's longest row, little once rows are sorted) plus a fixed cost per forward, with at most
``token_budget`` positions in a micro-batch of more than one row. The padded batch computes ``B x L`` positions,
the micro-batches ``sum_b b x L_b`` (``computed_positions``, reported as the forward's positions).

Positions are scored only where row token t predicts row token t+1 and the loss reads it (``scored``), and
scattered back to the padded [B, L-1] layout the loss uses: ``out[i, t]`` scores token t+1 of row i as the
padded forward does (up to float rounding), 0 where row i has no token t+1 or the loss does not read it. The
scatter is differentiable, so one backward through the loss reaches every micro-batch's forward.
"""

from __future__ import annotations

import logging

import torch

from relayrl.trainer.head import scored_logprobs

log = logging.getLogger(__name__)

# trainer.padding_free "auto" packs a forward whose padding is at least this share of its positions: below it the
# saved positions do not pay for the extra, smaller forwards.
AUTO_MIN_PADDING_SHARE = 0.25
# rotary scalings whose frequencies follow the longest position of each forward (dynamic NTK; LongRoPE's short and
# long factors): a forward of other lengths than the padded batch's would rotate by other frequencies
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
# A forward's fixed cost (its kernels' launches, Python, autograd), counted in positions: a micro-batch is worth
# splitting where that saves more padded positions than this.
FORWARD_COST = 128


def rope_unsupported(config) -> str | None:
    """Why forwards of other lengths than the padded batch's would change ``config``'s rotary embeddings (None: they
    do not). ``rope_parameters`` is one dict, or one per layer type (Gemma3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = list(params.values()) if all(isinstance(v, dict) for v in params.values()) else [params]
    types = sorted({kind.get("rope_type", kind.get("type")) for kind in kinds} & set(POSITION_DEPENDENT_ROPE))
    if types:
        return f"rope_type {', '.join(types)} rescales the rotary frequencies by each forward's longest position"
    return None


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Row indices per micro-batch (module docstring): rows sorted longest first (ties in row order) and cut into
    runs that minimise ``sum_b (b x L_b + FORWARD_COST)``, a run of more than one row holding ``b x L_b <=
    token_budget`` positions (a longer row goes alone). Every row appears exactly once.

    A micro-batch's cost depends only on its row count and its longest row, so swapping a longer row of a
    micro-batch with a shorter one of another whose longest row is longer never costs more: some optimum takes
    runs of the sorted rows, found by ``best[j] = min_i best[i] + (j - i) x L_i + FORWARD_COST`` over the first j."""
    if token_budget < 1:
        raise ValueError(f"token_budget: must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    sizes = [lengths[i] for i in order]
    best, cut = [0] + [0] * len(sizes), [0] * (len(sizes) + 1)  # best cost of the first j rows, where its run starts
    for j in range(1, len(sizes) + 1):
        best[j], cut[j] = best[j - 1] + sizes[j - 1] + FORWARD_COST, j - 1  # row j - 1 alone
        for i in range(j - 2, -1, -1):  # rows i .. j - 1 together, L_i the longest
            if (j - i) * sizes[i] > token_budget:
                break
            if (cost := best[i] + (j - i) * sizes[i] + FORWARD_COST) < best[j]:
                best[j], cut[j] = cost, i
    batches, j = [], len(sizes)
    while j:
        batches.append(order[cut[j] : j])
        j = cut[j]
    return batches[::-1]


def computed_positions(batches: list[list[int]], lengths: list[int]) -> int:
    """Positions the micro-batches ``batches`` (of ``micro_batches(lengths, ...)``) compute: ``sum_b b x L_b``."""
    return sum(len(batch) * lengths[batch[0]] for batch in batches)


def packed_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    scored: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    *,
    device: torch.device,
    token_budget: int,
    min_forwards: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of the next token, entropy), both [B, L-1] on ``device``, of the right-padded rows
    ``input_ids`` / ``attention_mask`` [B, L], forwarded in length buckets (module docstring); 0 except at the
    positions ``scored`` [B, L-1] (within each row), which go through the head in ``dtype`` (trainer/head.py).

    ``min_forwards``: forwards to make at least; the missing ones forward one token whose result enters the output
    times zero (FSDP ranks must all make the same forward and backward calls)."""
    lengths = attention_mask.sum(-1).tolist()
    batches = micro_batches(lengths, token_budget)
    at_rows, at_cols, logprobs, entropies = [], [], [], []
    for batch in batches:
        index = torch.tensor(batch)
        span = lengths[batch[0]]  # the micro-batch's longest row
        tokens = input_ids[index, :span].to(device)
        rows_at, cols_at = scored[index, : span - 1].to(device).nonzero(as_tuple=True)
        logprob, entropy = scored_logprobs(model, tokens, None, rows_at, cols_at, temperature, dtype)
        logprobs.append(logprob)
        entropies.append(entropy)
        at_rows.append(index.to(device)[rows_at])
        at_cols.append(cols_at)
    return assemble(model, logprobs, entropies, at_rows, at_cols, scored.shape, device, min_forwards)


def assemble(
    model: torch.nn.Module,
    logprobs: list[torch.Tensor],
    entropies: list[torch.Tensor],
    at_rows: list[torch.Tensor],
    at_cols: list[torch.Tensor],
    shape: torch.Size,
    device: torch.device,
    min_forwards: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob, entropy) float32 ``shape`` [B, L-1]: each forward's scored values at its rows ``at_rows`` and
    columns ``at_cols`` of the padded layout, 0 elsewhere (differentiable into the values); then one-token forwards
    whose output enters times zero, up to ``min_forwards`` forwards in all (FSDP ranks make the same calls)."""
    at = (torch.cat(at_rows).to(device), torch.cat(at_cols).to(device)) if logprobs else None
    logprob, entropy = (scatter(torch.cat(v) if v else None, at, shape, device) for v in (logprobs, entropies))
    for _ in range(min_forwards - len(logprobs)):
        one = torch.zeros(1, 1, dtype=torch.long, device=device)
        logprob = logprob + 0.0 * model(input_ids=one, use_cache=False).logits.sum()
    return logprob, entropy


def scatter(
    values: torch.Tensor | None, at: tuple[torch.Tensor, torch.Tensor] | None, shape: torch.Size, device=None
) -> torch.Tensor:
    """A float32 [B, L-1] of zeros with ``values`` at positions ``at`` (differentiable into ``values``)."""
    out = torch.zeros(shape, dtype=torch.float32, device=device if values is None else values.device)
    return out if values is None else out.index_put(at, values)


class PaddingFree:
    """``trainer.padding_free`` for one backend: whether each forward packs, and what the forwards computed.

    ``mode`` "on" packs every forward, "off" none, "auto" those whose padding share (1 - tokens / positions of
    the padded layout) reaches ``AUTO_MIN_PADDING_SHARE``; ``available`` False (with its ``reason``): never.
    The first decision of each kind (packed, padded) is logged with the padding share that made it."""

    def __init__(self, mode: str, token_budget: int, *, available: bool = True, reason: str = "") -> None:
        self.mode, self.token_budget, self.available, self.reason = mode, token_budget, available, reason
        self._logged: set[bool] = set()
        # since the last take(): positions computed, real tokens, forwards, packed forwards, the rows' tokens
        self.counts = torch.zeros(5, dtype=torch.float64)

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

    def record(self, tokens: int, positions: int, packed: bool, row_tokens: int | None = None) -> None:
        """A forward that computed ``positions`` positions for ``tokens`` real tokens, of rows that hold
        ``row_tokens`` (None: ``tokens``; more where shared prefixes were forwarded once: trainer/prefix.py)."""
        rows = tokens if row_tokens is None else row_tokens
        self.counts += torch.tensor([positions, tokens, 1, float(packed), rows], dtype=torch.float64)

    def take(self) -> torch.Tensor:
        """The counts since the last call (then zeroed): [positions computed, real tokens, forwards, packed, the
        rows' tokens]."""
        counts, self.counts = self.counts, torch.zeros(5, dtype=torch.float64)
        return counts
