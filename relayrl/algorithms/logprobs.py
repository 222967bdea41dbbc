"""Per-token log-probabilities and entropy from logits: shared by the engine and the trainer.

Convention (as verl): logprobs are those of the *sampling* distribution, softmax(logits / T), before
top-p truncation. The engine and the trainer both use these two functions, so their numbers agree.
"""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[label] for every position.

    logits: [..., V]; labels: [...] (int64). Returns [...] in float32.
    """
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    logz = torch.logsumexp(scaled, dim=-1)
    picked = torch.gather(scaled, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - logz


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) * z with z = logits / T, per position; [...] float32."""
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    probs = torch.softmax(scaled, dim=-1)
    return torch.logsumexp(scaled, dim=-1) - (probs * scaled).sum(-1)
