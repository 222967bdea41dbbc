"""How a trainer backend holds precision (DESIGN.md "Precision"), one object shared by every trained model.

- ``params`` (float32, always): the trained parameters and the optimizer state. An AdamW update at lr 1e-6 is far
  below half a bf16 ulp of a typical weight (~6e-5 at 0.02), so a bf16 parameter updated in place would not move.
- ``compute``: the dtype matmuls run in (``trainer.precision``). One rank: the float32 module under
  ``autocast``; FSDP2 on several ranks: ``fsdp_policy`` (bf16 all-gathered parameters, float32 gradient
  reduction); Megatron: a bf16 model whose float32 main parameters the optimizer steps.
- ``reference``: the frozen reference model's weights (``trainer.reference_dtype``): never updated, so bf16 is safe.
- ``engine``: the dtype weight sync sends (``rollout.weight_dtype``). The trainer casts while it gathers, once per
  weight on rank 0, into the send buffers: a bf16 engine then receives half the bytes, and no worker casts.
Logprobs, losses, advantages and entropies reduce in float32 whatever ``compute`` is. On a CPU, attention of a
model that trains runs in float32 under bf16 compute (``FLOAT32_SDPA``): torch's CPU flash-attention backward is
~4x slower in bf16 than in float32, which costs more than the float32 attention's forward.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from relayrl.config import TrainerConfig
from relayrl.runtime.precision import compute_dtype, follow

log = logging.getLogger(__name__)

FLOAT32_SDPA = "relayrl_sdpa_float32"  # the attention implementation of a trained model on a CPU under bf16


def float32_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention over float32 query, key and value (autocast off), the output in the query's
    dtype: registered as ``FLOAT32_SDPA``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(query.dtype), weights


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype
    reference: torch.dtype
    engine: torch.dtype
    params: ClassVar[torch.dtype] = torch.float32

    @classmethod
    def resolve(cls, cfg: TrainerConfig, weight_dtype: str, device: torch.device) -> Precision:
        """From ``trainer.precision``, ``trainer.reference_dtype`` and ``rollout.weight_dtype`` on ``device``;
        logs the choice and why."""
        compute, why = compute_dtype(cfg.precision, device.type)
        precision = cls(compute, follow(cfg.reference_dtype, compute), follow(weight_dtype, compute))
        log.info(
            "trainer.precision=%s: %s compute (%s), float32 parameters and optimizer state; reference %s, engine %s",
            cfg.precision, name(compute), why, name(precision.reference), name(precision.engine),
        )  # fmt: skip
        return precision

    @property
    def mixed(self) -> bool:
        """Whether compute runs below the parameters' float32."""
        return self.compute != self.params

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """A trained model's forward context: on one rank autocast to ``compute`` (nothing at float32); on several,
        nothing (``fsdp_policy`` casts). Backward runs outside it, in the dtypes the forward chose, as torch's
        autocast recipe has it."""
        if not self.mixed or dist.get_world_size() > 1:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute)

    def prepare(self, model: torch.nn.Module, device: torch.device) -> None:
        """A model that trains on ``device``: on a CPU under bf16 compute, its SDPA attention runs in float32
        (module docstring); elsewhere nothing changes."""
        if self.mixed and device.type == "cpu" and getattr(model.config, "_attn_implementation", None) == "sdpa":
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionInterface.register(FLOAT32_SDPA, float32_sdpa)
            # SDPA's masks too: an implementation without a mask function gets no mask from transformers (no sliding
            # window, no padding), only the causal kernel
            AttentionMaskInterface.register(FLOAT32_SDPA, sdpa_mask)
            model.set_attn_implementation(FLOAT32_SDPA)

    def fsdp_policy(self):
        """FSDP2's MixedPrecisionPolicy: parameters all-gathered in ``compute``, gradients reduced in float32 into
        float32 shards."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not self.mixed:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=torch.float32)


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
