"""The scored positions' logprobs and entropies through the output head, in chunks of rows.

A forward computes the decoder's last hidden states and no logits (``logits_to_keep`` empty); only the positions
the loss reads (``scored``: the response tokens) go through the head, ``chunk_rows`` at a time:

    logits_c = h_c W^T (in the compute dtype), z_c = float32(logits_c) / T
    logprob = z[label] - logsumexp(z),  entropy = logsumexp(z) - sum softmax(z) z

with ``logprobs_from_logits`` / ``entropy_from_logits``, the engine's functions. Backward recomputes each chunk's
logits instead of keeping them: the float32 [rows, vocab] logits and their gradient live one chunk at a time.
With p = softmax(z) and E = sum p z, d logprob / dz = onehot(label) - p and d entropy / dz = -p (z - E), so

    dL/dz = g_lp (onehot - p) - g_H p (z - E),   dL/dh_c = (dL/dz / T) W,   dL/dW = sum_c (dL/dz_c / T)^T h_c

(z - E = log p + H, computed in place on one float32 buffer a chunk; no g_H term where the entropy is only a
metric; the two matmuls in the compute dtype, dL/dW summed over chunks in float32). A head the chunks cannot reproduce
(a bias, logit soft-capping or scaling) takes the model's own logits at the scored positions instead.
"""

from __future__ import annotations

import torch

from relayrl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits

# float32 logits elements per chunk (128 MiB): a chunk's logits, probabilities and gradient stay in cache-friendly
# sizes while each matmul keeps enough rows to run at full rate.
CHUNK_ELEMENTS = 2**25
# config attributes that transform the head's logits in the model's own forward (Gemma2, Cohere)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale")


def chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


class HeadLogprobs(torch.autograd.Function):
    """(logprob, entropy) [N] float32 of ``hidden`` [N, H] through ``weight`` [V, H] (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, dtype: torch.dtype):
        rows = chunk_rows(weight.shape[0])
        logprob = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprob)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, hidden.shape[0], rows):
                end = start + rows
                logits = hidden[start:end].to(dtype) @ w.T
                logprob[start:end] = logprobs_from_logits(logits, labels[start:end], temperature)
                entropy[start:end] = entropy_from_logits(logits, temperature)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.temperature, ctx.dtype = temperature, dtype
        ctx.set_materialize_grads(False)  # an entropy that reaches no loss (a metric) is skipped in backward
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        """dL/dz = g_lp onehot - p (g_lp + g_H (log p + H)) (z - E = log p + H), in place on one [rows, V] float32
        buffer; a gradient autograd left out (None: that output reaches no loss) costs nothing."""
        hidden, weight, labels = ctx.saved_tensors
        temperature, dtype = ctx.temperature, ctx.dtype
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None
        if grad_logprob is None:
            grad_logprob = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        rows = chunk_rows(weight.shape[0])
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], rows):
            end = start + rows
            h = hidden[start:end].to(dtype)
            logp = (h @ w.T).float()
            if temperature != 1.0:
                logp.div_(temperature)
            logp.sub_(torch.logsumexp(logp, dim=-1, keepdim=True))
            p = logp.exp()
            g_lp = grad_logprob[start:end, None]
            if grad_entropy is None:
                grad_z = p.mul_(-g_lp)
            else:
                entropy = -(p * logp).sum(-1, keepdim=True)
                grad_z = logp.add_(entropy).mul_(grad_entropy[start:end, None]).add_(g_lp).mul_(p).neg_()
            grad_z.scatter_add_(-1, labels[start:end, None], g_lp)
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_z = grad_z.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_z @ w).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                grad_weight += (grad_z.T @ h).float()
        grad_weight = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None


def chunkable(model: torch.nn.Module) -> bool:
    """Whether the model's logits are its head's plain matmul (no bias, no soft-capping or scaling)."""
    head = model.get_output_embeddings()
    return (
        isinstance(head, torch.nn.Linear)
        and head.bias is None
        and not any(getattr(model.config, name, None) for name in LOGIT_TRANSFORMS)
    )


def scored_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    rows: torch.Tensor,
    cols: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    *,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``input_ids`` [B, L] (``attention_mask`` None: causal only; a 4D boolean one is taken as
    is, with its ``position_ids``); (logprob, entropy) [N] float32 of ``labels`` [N] (None: token ``cols + 1``)
    at positions (``rows``, ``cols``), the scored ones. ``model``: a causal LM (a PEFT wrapper's base model
    answers ``get_output_embeddings``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    labels = input_ids[rows, cols + 1] if labels is None else labels
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    if not chunkable(base):
        logits = model(**inputs, use_cache=False).logits[rows, cols]
        return logprobs_from_logits(logits, labels, temperature), entropy_from_logits(logits, temperature)
    out = model(
        **inputs, use_cache=False, output_hidden_states=True,
        logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
    )  # fmt: skip
    hidden = out.hidden_states[-1][rows, cols]
    return HeadLogprobs.apply(hidden, base.get_output_embeddings().weight, labels, temperature, dtype)
