"""On-policy distillation's per-token advantage (Agarwal et al. 2024, GKD; Thinking Machines' "On-Policy
Distillation", 2025): the student samples, a teacher scores the sampled tokens, and the per-token reverse KL is the
(negated) advantage. Registered as the estimator ``distill`` with its own signature (the trainer calls it with the
teacher's log-probs; ``compute_advantages`` refuses it), as ``gae`` is."""

from __future__ import annotations

import torch

from relayrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from relayrl.algorithms.aggregation import masked_fill_zero


@ADVANTAGE_ESTIMATORS.register("distill")
def distill_advantage(
    student_logprob: torch.Tensor, teacher_logprob: torch.Tensor, mask: torch.Tensor, *, coef: float = 1.0
) -> torch.Tensor:
    """A_t = −coef · (log π_student(y_t) − log π_teacher(y_t)) on the sampled tokens y_t; 0 where ``mask`` is 0.

    All [B, T]: the student's log-probs of its own sampled tokens (under the sampling temperature, as the trainer
    scores them), the teacher's of the same token ids, and the response mask. Σ_t of the negated advantage is the
    sampled estimate of the reverse KL(π_student || π_teacher) over the response, so a policy-gradient step on A
    lowers it; a token the teacher finds likelier than the student gets a positive advantage. Detached (an
    advantage carries no gradient); ``with_task_advantage`` adds a task reward's advantage to it."""
    if student_logprob.dim() != 2:
        raise ValueError(f"student_logprob: expected a 2-D tensor [B, T], got shape {tuple(student_logprob.shape)}")
    for name, tensor in (("teacher_logprob", teacher_logprob), ("mask", mask)):
        if tensor.shape != student_logprob.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(student_logprob.shape)} like student_logprob, got {tuple(tensor.shape)}"
            )
    if not coef > 0:
        raise ValueError(f"coef: must be > 0, got {coef}")
    reverse_kl = (student_logprob - teacher_logprob).detach()
    return masked_fill_zero(-coef * reverse_kl, (mask != 0).to(reverse_kl.dtype))


def mean_reverse_kl(student_logprob: torch.Tensor, teacher_logprob: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean reverse KL per sampled token, Σ_t m_t (log π_student(y_t) − log π_teacher(y_t)) / Σ_t m_t over the
    [B, T] tensors of ``distill_advantage`` (0 for a batch without a masked-in token): the sampled estimate the
    distillation advantage lowers, logged each step as ``distill/reverse_kl``."""
    weights = (mask != 0).to(torch.float64)
    diff = masked_fill_zero((student_logprob - teacher_logprob).detach().to(torch.float64), weights)
    return float(diff.sum() / weights.sum().clamp(min=1.0))


def with_task_advantage(
    task_advantage: torch.Tensor, token_advantage: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """A_t = A_task(i) + A_distill(i, t) on each response token t of sample i; 0 where ``mask`` is 0.

    ``task_advantage`` [B]: each sample's advantage from its task reward (an outcome estimator's: grpo, rloo, ...);
    ``token_advantage`` [B, T]: ``distill_advantage``'s (its coefficient applied); ``mask`` [B, T]. The task's
    advantage reaches every token of its sample, as an outcome estimator's does in the policy loss. Detached."""
    if task_advantage.shape != token_advantage.shape[:1] or token_advantage.dim() != 2:
        raise ValueError(
            f"task_advantage: expected shape ({token_advantage.shape[0]},) for token_advantage of shape "
            f"{tuple(token_advantage.shape)}, got {tuple(task_advantage.shape)}"
        )
    if mask.shape != token_advantage.shape:
        raise ValueError(f"mask: expected shape {tuple(token_advantage.shape)}, got {tuple(mask.shape)}")
    combined = task_advantage.detach().to(token_advantage.dtype)[:, None] + token_advantage.detach()
    return masked_fill_zero(combined, (mask != 0).to(combined.dtype))
