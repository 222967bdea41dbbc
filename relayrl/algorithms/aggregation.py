"""Reduce a per-token loss matrix [B, T] to a scalar, by named mode (as verl's ``agg_loss``).

Positions where ``mask`` is 0 are excluded with ``torch.where``, so they may hold any value (even NaN).
``mask`` may be bool or float; a float mask weights tokens.

``num_tokens`` / ``num_seqs`` let a data-parallel caller pass *global* counts (summed over ranks); the
caller then multiplies the result by the world size, because gradient all-reduce averages over ranks.
Each mode reads only the counts its formula uses and ignores the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from relayrl.registry import Registry

AggregationFn = Callable[..., torch.Tensor]
LOSS_AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation mode")


def masked_fill_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x · mask, with masked-out positions exactly 0 whatever x holds there."""
    return torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x · mask (over ``dim``, or everything)."""
    y = masked_fill_zero(x, mask)
    return y.sum() if dim is None else y.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ x · mask / Σ mask; 0 when the mask is empty."""
    total = masked_sum(x, mask)
    return _safe_div(total, mask.sum().to(total.dtype))


def _check(loss_mat: torch.Tensor, mask: torch.Tensor) -> None:
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat: expected a 2-D tensor [B, T], got shape {tuple(loss_mat.shape)}")
    if mask.shape != loss_mat.shape:
        raise ValueError(f"mask: expected shape {tuple(loss_mat.shape)} like loss_mat, got {tuple(mask.shape)}")


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name}: must be > 0, got {value}")


def _safe_div(num: torch.Tensor, den: torch.Tensor | float) -> torch.Tensor:
    """num / den, and 0 (not NaN) when den is 0."""
    den_t = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return torch.where(den_t != 0, num / torch.where(den_t != 0, den_t, 1), torch.zeros_like(num))


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """DAPO token-level mean: L = Σ_{i,t} loss·mask / num_tokens, num_tokens defaults to Σ mask."""
    _check(loss_mat, mask)
    _positive("num_tokens", num_tokens)
    den = mask.sum().to(loss_mat.dtype) if num_tokens is None else float(num_tokens)
    return _safe_div(masked_sum(loss_mat, mask), den)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """L = Σ_i (Σ_t loss·mask) / num_seqs, num_seqs defaults to B."""
    _check(loss_mat, mask)
    _positive("num_seqs", num_seqs)
    den = float(loss_mat.shape[0]) if num_seqs is None else float(num_seqs)
    return _safe_div(masked_sum(loss_mat, mask), den)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Original GRPO: L = Σ_i (Σ_t loss·mask / Σ_t mask) / num_seqs.

    Rows with no tokens contribute 0; num_seqs defaults to the number of rows with at least one token.
    """
    _check(loss_mat, mask)
    _positive("num_seqs", num_seqs)
    row_sum = masked_sum(loss_mat, mask, dim=-1)
    row_tok = mask.sum(-1).to(row_sum.dtype)
    row_mean = _safe_div(row_sum, row_tok)
    den = (row_tok != 0).sum().to(row_sum.dtype) if num_seqs is None else float(num_seqs)
    return _safe_div(row_mean.sum(), den)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Dr.GRPO: L = Σ_{i,t} loss·mask / (num_seqs · norm_len); num_seqs defaults to B, norm_len to T."""
    _check(loss_mat, mask)
    _positive("num_seqs", num_seqs)
    _positive("norm_len", norm_len)
    seqs = float(loss_mat.shape[0]) if num_seqs is None else float(num_seqs)
    length = float(loss_mat.shape[-1]) if norm_len is None else float(norm_len)
    return _safe_div(masked_sum(loss_mat, mask), seqs * length)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` [B, T] to a scalar with the LOSS_AGGREGATIONS mode ``mode``.

    Raises KeyError naming ``mode`` when it is unknown. See each mode's docstring for its formula.
    """
    fn = LOSS_AGGREGATIONS.get(mode)
    return fn(loss_mat, mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)


# Each mode is L = S / D: S a sum over the rows' tokens, D built from the global counts alone. With unit counts
# (UNIT_COUNTS) every mode returns S, so a mini-batch can be accumulated in pieces and divided by D once.
UNIT_COUNTS = {"num_tokens": 1.0, "num_seqs": 1.0, "norm_len": 1}
_DENOMINATORS: dict[str, Callable[[float, float, int], float]] = {
    "token-mean": lambda tokens, seqs, length: tokens,
    "seq-mean-token-sum": lambda tokens, seqs, length: seqs,
    "seq-mean-token-mean": lambda tokens, seqs, length: seqs,
    "seq-mean-token-sum-norm": lambda tokens, seqs, length: seqs * length,
}


def agg_denominator(mode: str, *, num_tokens: float, num_seqs: float, norm_len: int) -> float:
    """D of ``mode`` for these global counts: agg_loss(x, counts) = agg_loss(x, UNIT_COUNTS) / D."""
    if mode not in _DENOMINATORS:
        raise KeyError(f"loss aggregation mode {mode!r} has no known denominator (it cannot be accumulated)")
    return float(_DENOMINATORS[mode](num_tokens, num_seqs, norm_len))
