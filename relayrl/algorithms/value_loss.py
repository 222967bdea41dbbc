"""The critic's loss: a clipped squared error against GAE returns (as verl's ``compute_value_loss``).

Normalisation: the loss is aggregated with ``agg_loss`` and the *mini-batch's* global counts (``num_tokens``,
``num_seqs``), as the policy's loss is, never a micro-batch's own: normalising each micro-batch (or each rank's
shard) by its own token count and averaging scales every token's gradient by the number of pieces the
mini-batch was cut into, which changes the critic's effective lr with the micro-batch size (the bug verl
PR #6957 fixed). With global counts the pieces' losses sum to the whole mini-batch's.
"""

from __future__ import annotations

import torch

from relayrl.algorithms.aggregation import agg_loss, masked_mean


def _check(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask: expected a 2-D tensor [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(f"{name}: expected shape {tuple(mask.shape)} like mask, got {tuple(t.shape)}")


def clipped_value_loss(
    vpreds: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss, aggregated; returns (scalar loss, metrics).

        V_clip = old + clamp(V − old, −c, c)            (c = cliprange_value, in reward units)
        l_t    = ½ · max((V − R)², (V_clip − R)²)
        L      = agg_loss(l, mask, loss_agg, num_tokens, num_seqs, norm_len)

    ``vpreds`` V are the critic's values being trained, ``old_values`` those at the step's starting weights (the
    ones GAE used), ``returns`` R the GAE returns. Metrics (detached masked means): value_clip_frac (the clipped
    branch is the larger: (V_clip − R)² > (V − R)²), vpred_mean.
    """
    _check(mask, vpreds=vpreds, old_values=old_values, returns=returns)
    if not cliprange_value > 0:
        raise ValueError(f"cliprange_value: must be > 0, got {cliprange_value}")
    clipped = old_values + torch.clamp(vpreds - old_values, -cliprange_value, cliprange_value)
    unclipped_sq = (vpreds - returns) ** 2
    clipped_sq = (clipped - returns) ** 2
    loss_mat = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
    loss = agg_loss(loss_mat, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        metrics = {
            "value_clip_frac": masked_mean((clipped_sq > unclipped_sq).float(), mask),
            "vpred_mean": masked_mean(vpreds.detach().float(), mask),
        }
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 − Var(R − V) / Var(R) over the masked tokens (population variances); 1 is a perfect critic, 0 one that
    predicts the mean, < 0 worse. Returns with no variance (or no masked token) give 0."""
    _check(mask, values=values, returns=returns)
    m = mask.double()
    r, v = returns.double(), values.double()
    var_r = masked_mean((r - masked_mean(r, m)) ** 2, m)
    err = r - v
    var_err = masked_mean((err - masked_mean(err, m)) ** 2, m)
    if var_r <= 0:
        return torch.zeros((), dtype=torch.float64)
    return 1.0 - var_err / var_r
