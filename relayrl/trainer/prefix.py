"""Shared-prefix forwards (``trainer.shared_prefix``): a group's rows begin with one prompt, forwarded once.

The k rows of a GRPO group (one ``groups`` id) that begin with the same P tokens are laid out as one sequence

    [prefix (P tokens), suffix_1, ..., suffix_k],   suffix_i = row_i[P : len_i]

with position ids 0..P-1 on the prefix and P..len_i-1 on suffix i, under an attention mask where a position
sees the prefix up to itself and the earlier positions of its own suffix, never another suffix. Row i's
position t then sees the same tokens at the same positions as in its own causal forward, so it computes the
same hidden state (up to float rounding). It sits at layout position t if t < P, else at ``offset_i + t - P``
(``offset_i = P + sum_{j<i} (len_j - P)``): the prefix's last position P-1 scores every row's first token
after the prefix, each row with its own label; where the responses begin alike, P reaches into them and their
common tokens are scored once per row from one shared position.

A group computes ``T_g = P + sum_i (len_i - P)`` positions instead of ``sum_i len_i``: with k samples of a
P-token prompt, (k - 1) P fewer. Layouts are bucketed by length into micro-batches as padding-free rows are
(relayrl/trainer/packing.py). Attention within a layout takes a materialised [T_g, T_g] mask (no causal
kernel, no block skipped), so ``auto`` shares only where every layout fits the micro-batch token budget and the
sharing saves at least ``AUTO_MIN_SAVED_SHARE`` of the rows' positions.

The mask is given in the form the model's attention reads (``mask_argument``): boolean for SDPA (True attends),
additive for eager attention (0 or the float32 minimum, added to the scores), and for each kind of layer its own:
a sliding-window layer (Mistral, Gemma2/3, gpt-oss, Qwen2 with its window on) sees a key k from query q only where
``pos_q - pos_k < sliding_window``, in position ids (in layout indices a suffix is further from the prefix). Whether
a model's forward reproduces its padded rows under the layout is decided once, on a probe (``layout_unsupported``);
where it cannot, groups are never shared and a log line says why.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from relayrl.trainer.head import scored_logprobs
from relayrl.trainer.packing import assemble, micro_batches, rope_unsupported
from relayrl.trainer.precision import FLOAT32_SDPA

log = logging.getLogger(__name__)

# trainer.shared_prefix "auto" shares where that saves at least this share of the rows' positions: below it the
# masked attention and the smaller forwards do not pay.
AUTO_MIN_SAVED_SHARE = 0.25
# attention implementations that apply a custom 4D mask as given (transformers' sdpa and eager, and relayrl's
# float32 SDPA of trainer/precision.py); flash-attention kernels take none
MASKED_ATTENTION = ("sdpa", "eager", FLOAT32_SDPA)
# the layer types (config.layer_types) whose attention a layout's mask reproduces
LAYER_TYPES = ("full_attention", "sliding_attention")
# the probe's largest gap |shared - padded| / max |padded logits| where the layout holds (float32 rounding, with
# room); a mask the attention misreads misses by ~0.1
PROBE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class GroupLayout:
    """One group's rows (batch indices, in order), their lengths and the prefix ``prefix`` they all begin with."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    prefix: int

    @property
    def length(self) -> int:
        """T_g: the layout's positions."""
        return self.prefix + sum(n - self.prefix for n in self.lengths)

    def positions(self) -> tuple[list[int], list[int]]:
        """(position id, segment) of each layout position: segment 0 the prefix, i + 1 suffix i."""
        ids, segments = list(range(self.prefix)), [0] * self.prefix
        for i, n in enumerate(self.lengths):
            ids += range(self.prefix, n)
            segments += [i + 1] * (n - self.prefix)
        return ids, segments

    def where(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Layout positions of row ``i``'s positions ``t`` (module docstring)."""
        offset = self.prefix + sum(n - self.prefix for n in self.lengths[:i])
        return torch.where(t < self.prefix, t, t + offset - self.prefix)


def mask_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model``'s attention cannot take a layout's mask (None: it can), from its config."""
    config = model.config
    attention = getattr(config, "_attn_implementation", None)
    if attention not in MASKED_ATTENTION:
        return (
            f"attention {attention!r} takes no [T, T] mask (shared prefixes need one of {', '.join(MASKED_ATTENTION)})"
        )
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES))
    if unknown:
        return f"layer types {unknown} (a layout's mask reproduces {', '.join(LAYER_TYPES)} only)"
    return rope_unsupported(config)


_UNSUPPORTED: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def layout_unsupported(model: torch.nn.Module) -> str | None:
    """Why shared prefixes are not exact on ``model`` (None: they are): ``mask_unsupported``, else a probe of two
    rows sharing a prefix, whose layout forward must give their padded forward's logits (``PROBE_TOLERANCE``);
    decided on first use and kept (probe a model before FSDP shards it: ``fsdp.load_trained_model``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base not in _UNSUPPORTED:
        _UNSUPPORTED[base] = mask_unsupported(base) or probe_layout(base)
    return _UNSUPPORTED[base]


@torch.no_grad()
def probe_layout(model: torch.nn.Module) -> str | None:
    """Two rows [1 .. 7] and [1, 2, 3, 8, 9] forwarded padded and as one layout sharing [1, 2, 3]: why their logits
    differ by more than ``PROBE_TOLERANCE`` of the largest (None: they do not)."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    rows = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 8, 9, 0, 0]]) % vocab
    layouts = [GroupLayout((0, 1), (7, 5), 3)]
    tokens, position_ids, mask = layout_inputs(layouts, rows, device)
    shared = model(
        input_ids=tokens, attention_mask=mask_argument(model, mask, position_ids), position_ids=position_ids,
        use_cache=False,
    ).logits[0]  # fmt: skip
    padded = model(input_ids=rows.to(device), use_cache=False).logits
    t = torch.arange(7)
    gap = max(
        float((shared[layouts[0].where(i, t[:n])] - padded[i, :n]).abs().max()) for i, n in enumerate((7, 5))
    ) / float(padded.abs().max())
    if gap > PROBE_TOLERANCE:
        return f"a probe's shared layout misses its padded rows' logits by {gap:.2g} of their largest"
    return None


def windowed(mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [b, 1, W, W] less the keys ``window`` or more positions before their query (in ``position_ids``
    [b, W]); a query still sees itself."""
    distance = position_ids[:, None, :, None] - position_ids[:, None, None, :]
    return mask & (distance < window)


def mask_argument(
    model: torch.nn.Module, mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The layout's boolean ``mask`` [b, 1, W, W] as ``model``'s forward takes it (module docstring): a dict by
    layer type where its config has ``layer_types`` (a sliding layer's mask ``windowed``), else one mask (windowed
    where the config has a ``sliding_window``: Mistral, Phi-3); additive for eager attention."""
    config = model.config
    window = getattr(config, "sliding_window", None)

    def form(seen: torch.Tensor) -> torch.Tensor:
        if config._attn_implementation != "eager":
            return seen
        return torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, torch.finfo(torch.float32).min)

    types = getattr(config, "layer_types", None)
    if types is None:
        return form(mask if window is None else windowed(mask, position_ids, window))
    sliding = "sliding_attention" in types and window is not None
    return {kind: form(windowed(mask, position_ids, window) if kind == "sliding_attention" and sliding else mask)
            for kind in set(types)}  # fmt: skip


def common_prefix(rows: torch.Tensor) -> int:
    """Length of the longest prefix every row of ``rows`` [k, n] begins with."""
    same = (rows == rows[:1]).all(0)
    return int(same.long().cumprod(0).sum())


def group_layouts(input_ids: torch.Tensor, lengths: list[int], groups: torch.Tensor) -> list[GroupLayout]:
    """One layout per group id of ``groups`` [B] (rows in batch order), over the right-padded ``input_ids``
    [B, L] whose row i holds ``lengths[i]`` tokens."""
    layouts = []
    for group in torch.unique(groups, sorted=True):
        rows = torch.nonzero(groups == group).flatten().tolist()
        prefix = common_prefix(input_ids[rows, : min(lengths[i] for i in rows)])  # a lone row: all of it
        layouts.append(GroupLayout(tuple(rows), tuple(lengths[i] for i in rows), prefix))
    return layouts


def layout_inputs(
    layouts: list[GroupLayout], input_ids: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, position ids [b, W], boolean attention mask [b, 1, W, W]) of ``layouts`` right-padded to the
    longest, W. Padding sees only itself (a query that sees nothing would make NaNs that reach the gradients)."""
    width = max(layout.length for layout in layouts)
    tokens = torch.zeros(len(layouts), width, dtype=torch.long)
    position_ids = torch.zeros_like(tokens)
    segments = torch.full_like(tokens, -1)
    for b, layout in enumerate(layouts):
        ids, segs = layout.positions()
        pieces = [input_ids[layout.rows[0], : layout.prefix]]
        pieces += [input_ids[row, layout.prefix : n] for row, n in zip(layout.rows, layout.lengths, strict=True)]
        tokens[b, : layout.length] = torch.cat(pieces)
        position_ids[b, : layout.length] = torch.tensor(ids)
        segments[b, : layout.length] = torch.tensor(segs)
    query, key = segments[:, :, None], segments[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = causal & (query >= 0) & (key >= 0) & ((key == 0) | (key == query)) | torch.eye(width, dtype=torch.bool)
    return tokens.to(device), position_ids.to(device), mask[:, None].to(device)


def shared_prefix_logprobs(
    model: torch.nn.Module,
    layouts: list[GroupLayout],
    input_ids: torch.Tensor,
    scored: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    *,
    device: torch.device,
    token_budget: int,
    min_forwards: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of the next token, entropy), both [B, L-1] on ``device``, of the right-padded rows ``input_ids``
    [B, L] forwarded as ``layouts`` (module docstring) in length buckets; 0 except at the positions ``scored``
    [B, L-1], which go through the head in ``dtype`` (trainer/head.py). ``min_forwards``: as in
    ``packing.packed_logprobs`` (FSDP ranks make the same forward calls)."""
    buckets = micro_batches([layout.length for layout in layouts], token_budget)
    at_rows, at_cols, logprobs, entropies = [], [], [], []
    for bucket in buckets:
        chosen = [layouts[b] for b in bucket]
        tokens, position_ids, mask = layout_inputs(chosen, input_ids, device)
        rows_at, cols_at, labels, batch_rows, batch_cols = [], [], [], [], []
        for b, layout in enumerate(chosen):
            for i, row in enumerate(layout.rows):
                t = scored[row].nonzero().flatten()
                rows_at.append(torch.full_like(t, b))
                cols_at.append(layout.where(i, t))
                labels.append(input_ids[row, t + 1])
                batch_rows.append(torch.full_like(t, row))
                batch_cols.append(t)
        logprob, entropy = scored_logprobs(
            model, tokens, mask_argument(model, mask, position_ids), torch.cat(rows_at).to(device),
            torch.cat(cols_at).to(device), temperature, dtype,
            position_ids=position_ids, labels=torch.cat(labels).to(device),
        )  # fmt: skip
        logprobs.append(logprob)
        entropies.append(entropy)
        at_rows.append(torch.cat(batch_rows))
        at_cols.append(torch.cat(batch_cols))
    return assemble(model, logprobs, entropies, at_rows, at_cols, scored.shape, device, min_forwards)


class SharedPrefix:
    """``trainer.shared_prefix`` for one backend: whether a forward lays its groups out with shared prefixes.

    ``mode`` "on" shares every forward that has groups, "off" none, "auto" those where sharing saves at least
    ``AUTO_MIN_SAVED_SHARE`` of the rows' positions and every layout fits ``token_budget`` (module docstring);
    ``available`` False (with its ``reason``): never. The first decision of each kind is logged with why."""

    def __init__(self, mode: str, token_budget: int, *, available: bool = True, reason: str = "") -> None:
        self.mode, self.token_budget, self.available, self.reason = mode, token_budget, available, reason
        self._logged: set[bool] = set()

    def decide(self, row_tokens: int, layout_tokens: int, longest_layout: int) -> bool:
        """Whether a forward of ``row_tokens`` real tokens, ``layout_tokens`` when shared, shares."""
        saved = 1.0 - layout_tokens / max(row_tokens, 1)
        fits = longest_layout <= self.token_budget
        share = self.available and (
            self.mode == "on" or (self.mode == "auto" and saved >= AUTO_MIN_SAVED_SHARE and fits)
        )
        if share not in self._logged:
            why = self.reason if not self.available else f"saves {saved:.2f} of the rows' positions"
            if self.mode == "auto" and self.available:
                why += f", auto shares from {AUTO_MIN_SAVED_SHARE:.2f}"
                why += "" if fits else f"; a layout of {longest_layout} positions exceeds trainer.pack_token_budget"
            log.info("trainer.shared_prefix=%s: %s (%s)", self.mode, "shared" if share else "not shared", why)
            self._logged.add(share)
        return share
