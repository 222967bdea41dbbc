"""Sequence log-probs of completions, many sequences packed into one forward (padding-free, as SFT's rows).

A sequence is (token ids, completion mask aligned to them: 1 on the completion's tokens). ``pack_examples`` lays the
sequences back to back with positions restarting at 0 and no attention mask, so each attends within itself only
(relayrl/algorithms/sft_loss.py); log π(completion | prompt) of sequence j = Σ over the targets it owns of the
target's log-prob (``sequence_logprobs``' sum over completion tokens only, the prompt's and the other sequences'
positions never counting).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from relayrl.algorithms.sft_loss import pack_examples
from relayrl.trainer.backends.fsdp import FSDPBackend


def completion_sequence(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """(prompt + completion ids, the completion mask)."""
    return [*prompt_ids, *completion_ids], [0] * len(prompt_ids) + [1] * len(completion_ids)


def reference_model(backend: FSDPBackend) -> tuple[torch.nn.Module, contextlib.AbstractContextManager]:
    """(the model that scores as the reference policy, the context to score in): the frozen reference where the
    backend holds one, else the policy itself, with ``model.lora`` under PEFT's ``disable_adapter`` (the base, no
    second copy). Without LoRA and a frozen copy the policy is the reference only before its first step (the
    caller's promise: reference log-probs computed before training)."""
    if backend.reference is not None and backend.lora is None:
        return backend.reference, contextlib.nullcontext()
    if backend.lora is not None:
        return backend.model, backend.model.disable_adapter()
    return backend.model, contextlib.nullcontext()


def packed_sequence_logps(
    backend: FSDPBackend, sequences: Sequence[tuple[list[int], list[int]]], *, reference: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(completion | prompt) [S] float32, completion token counts [S]) of ``sequences``, in one forward of the
    policy (with gradient where grad mode is on) or, ``reference``, of the reference policy without gradient."""
    batch = pack_examples(sequences)
    device = backend.device
    model, context = reference_model(backend) if reference else (backend.model, contextlib.nullcontext())
    grad = torch.is_grad_enabled() and not reference
    with context, torch.set_grad_enabled(grad), backend.precision.autocast(device):
        logits = model(
            input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device), use_cache=False
        ).logits
    logits = logits[0, :-1].float()
    targets, mask = batch.input_ids[0, 1:].to(device), batch.target_mask[0].to(device)
    logprob = -F.cross_entropy(logits, targets, reduction="none")
    owner = batch.example_ids[0].to(device).clamp(min=0)  # a position owned by none has mask 0
    logps = torch.zeros(len(sequences), device=device).index_add(0, owner, logprob * mask)
    tokens = torch.zeros(len(sequences), device=device).index_add(0, owner, mask)
    return logps, tokens
