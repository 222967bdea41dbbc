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
metric; the two matmuls in the compute dtype, dL/dW summed over chunks in float32).

Whether the chunks reproduce the model's logits is decided once per model, on a probe (``head_plan``): the decoder's
output is replaced by random hidden states H large enough that the head's logits reach tens, and the model's own
logits are fitted as ``s H W^T`` (least squares). Where the fit holds to float rounding, the chunked head computes
``s h W^T`` (a scale s != 1 is Granite's ``logits_scaling``, Cohere's ``logit_scale``, Falcon-H1's
``lm_head_multiplier``, MiniCPM's width scaling: folded into the temperature, z = h W^T / (T / s)); where it does not
(a bias, soft-capping, any other transform), the model's own logits are taken at the scored positions, and a log
line says why.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from relayrl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits

# float32 logits elements per chunk (128 MiB): a chunk's logits, probabilities and gradient stay in cache-friendly
# sizes while each matmul keeps enough rows to run at full rate.
CHUNK_ELEMENTS = 2**25
log = logging.getLogger(__name__)

# the probe's largest gap |logits - s H W^T| / max |logits| where the fit holds: float32 rounding of logits that
# reach tens, with room; a float32 soft-capping at 30 (Gemma2) misses by ~0.1
PROBE_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-5}
PROBE_TOLERANCE_HALF = 1e-2  # bfloat16 / float16 models
PROBE_LOGITS = 20.0  # the probe's logits' standard deviation: where soft-capping and other transforms show
PROBE_TOKENS = 4


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


@dataclass(frozen=True)
class HeadPlan:
    """How a model's scored logits are computed: ``scale`` s (the chunked head, logits = s h W^T) or None (the
    model's own logits), with ``reason`` why not."""

    scale: float | None
    reason: str = ""


_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, HeadPlan] = weakref.WeakKeyDictionary()


def head_plan(model: torch.nn.Module) -> HeadPlan:
    """``model``'s head plan (a PEFT wrapper's: its base model's), probed on first use (module docstring) and
    logged where the chunked head is off. Probe a model before FSDP shards it (``fsdp.load_trained_model``): a
    sharded one's head cannot be multiplied whole, and takes its own logits."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):  # a LoRA adapter on the head wraps it after the probe
        plan = HeadPlan(None, f"its output head is a {type(head).__module__}.{type(head).__name__}, not a torch Linear")
    else:
        plan = _PLANS[base] if base in _PLANS else probe_head(base)
    if _PLANS.get(base) != plan:
        _PLANS[base] = plan
        if plan.scale is None:
            log.info("chunked output head off for %s: %s; its own logits are used", type(base).__name__, plan.reason)
    return plan


def adopt_head_plan(model: torch.nn.Module, plan: HeadPlan) -> None:
    """``model`` (another copy of the same architecture and weights: the frozen reference) takes ``plan`` instead of
    probing (a bf16 copy's probe would fit its scale to bf16 rounding)."""
    _PLANS[model.get_base_model() if hasattr(model, "get_base_model") else model] = plan


@torch.no_grad()
def probe_head(model: torch.nn.Module) -> HeadPlan:
    """Fit the model's logits of random hidden states H (fed in place of its decoder's output) as s H W^T."""
    head = model.get_output_embeddings()
    if hasattr(head.weight, "full_tensor"):
        return HeadPlan(None, "its output head was sharded before the probe")
    if head.bias is not None:
        return HeadPlan(None, "its output head has a bias")
    weight = head.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(1, PROBE_TOKENS, weight.shape[1], generator=g).to(weight)
    plain = (hidden @ weight.T).double()
    hidden = hidden * (PROBE_LOGITS / float(plain.std()))
    plain = plain * (PROBE_LOGITS / float(plain.std()))

    def inject(module, args, output):
        output.last_hidden_state = hidden
        return output

    hook = model.get_decoder().register_forward_hook(inject)
    try:
        ids = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=weight.device)
        logits = model(input_ids=ids, use_cache=False).logits.double()
    finally:
        hook.remove()
    scale = float((logits * plain).sum() / (plain * plain).sum())
    gap = float((logits - scale * plain).abs().max() / logits.abs().max())
    if gap > PROBE_TOLERANCE.get(weight.dtype, PROBE_TOLERANCE_HALF):
        return HeadPlan(None, f"its logits are not a scale times the head's matmul (soft-capping or another "
                              f"transform: a probe's logits miss by {gap:.2g} of their largest)")  # fmt: skip
    return HeadPlan(1.0 if abs(scale - 1.0) < 1e-6 else scale)


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
    """One forward of ``input_ids`` [B, L] (``attention_mask`` None: causal only; a 4D one, or a dict of them by
    layer type, is taken as is, with its ``position_ids``); (logprob, entropy) [N] float32 of ``labels`` [N]
    (None: token ``cols + 1``) at positions (``rows``, ``cols``), the scored ones, through ``head_plan``'s head.
    ``model``: a causal LM (a PEFT wrapper's base model answers ``get_output_embeddings``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    labels = input_ids[rows, cols + 1] if labels is None else labels
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    scale = head_plan(base).scale
    if scale is None:
        logits = model(**inputs, use_cache=False).logits[rows, cols]
        return logprobs_from_logits(logits, labels, temperature), entropy_from_logits(logits, temperature)
    out = model(
        **inputs, use_cache=False, output_hidden_states=True,
        logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
    )  # fmt: skip
    hidden = out.hidden_states[-1][rows, cols]
    return HeadLogprobs.apply(hidden, base.get_output_embeddings().weight, labels, temperature / scale, dtype)
