"""Per-token log-probs and entropy from vocab-parallel logits (each TP rank holds a slice of the vocabulary).

The same numbers as ``algorithms/logprobs.py`` on the full logits: z = logits / T in float32, columns
beyond the real vocabulary (Megatron's padding to a multiple of TP) excluded from the softmax.
"""

from __future__ import annotations

import torch


def mask_padded_vocab(scaled: torch.Tensor, vocab: int) -> torch.Tensor:
    """``scaled`` [..., V/tp] with this rank's columns >= ``vocab`` at the dtype's lowest half (exp -> 0)."""
    from megatron.core import parallel_state as ps

    width = scaled.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    if start + width <= vocab:
        return scaled
    padded = torch.arange(start, start + width, device=scaled.device) >= vocab
    return scaled.masked_fill(padded, torch.finfo(scaled.dtype).min / 2)


def vocab_parallel_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(z)[label], H(softmax(z))), both [...] float32, from this rank's slice ``logits`` [..., V/tp].

    log-prob: -vocab_parallel_cross_entropy(z, label) (it edits its input in place: it gets its own copy).
    Entropy: log Z - sum_v p_v z_v with Z = sum_v exp(z_v - m), m the global max (no gradient), the two
    vocabulary sums all-reduced over the TP group (forward all-reduce, backward identity: Megatron's mapping).
    """
    from megatron.core import tensor_parallel
    from megatron.core.parallel_state import get_tensor_model_parallel_group

    scaled = mask_padded_vocab(logits.float() / temperature, vocab)
    logprob = -tensor_parallel.vocab_parallel_cross_entropy(scaled.clone().contiguous(), labels)
    local_max = scaled.detach().amax(dim=-1, keepdim=True)
    torch.distributed.all_reduce(local_max, op=torch.distributed.ReduceOp.MAX, group=get_tensor_model_parallel_group())
    shifted = scaled - local_max
    exp = shifted.exp()
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
    sums = tensor_parallel.reduce_from_tensor_model_parallel_region(sums)
    entropy = sums[0].log() - sums[1] / sums[0]
    return logprob, entropy
