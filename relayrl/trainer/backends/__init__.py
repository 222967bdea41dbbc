"""Training backends: how the policy is sharded, stepped, gathered and checkpointed.

Both expose the same interface to the training step: ``device``, ``weight_names``, ``dp_rank``/``dp_size``
(the data-parallel rank and size the step shards rows by), ``logprobs``, ``step``,
``weight_specs``, ``gather_weights``, ``save_checkpoint``, ``load_checkpoint``, ``export_hf``, and ``lora`` (the
adapter's spec when ``model.lora`` trains one, FSDP only: then ``weight_specs``/``gather_weights`` take a ``kind``,
"base" or "adapter"; else None).
"""

from __future__ import annotations

from relayrl.config import ModelConfig, TrainerConfig
from relayrl.trainer.backends.fsdp import FSDPBackend


def create_backend(model_cfg: ModelConfig, cfg: TrainerConfig, *, with_reference: bool):
    """The backend ``cfg.backend`` names (Megatron-core is imported only when chosen: an optional extra)."""
    if cfg.backend == "megatron":
        try:
            from relayrl.trainer.backends.megatron import MegatronBackend
        except ImportError as err:
            raise ImportError(
                f"trainer.backend: megatron needs megatron-core (pip install 'relayrl[megatron]'): {err}"
            ) from err
        return MegatronBackend(model_cfg, cfg, with_reference=with_reference)
    return FSDPBackend(model_cfg, cfg, with_reference=with_reference)


__all__ = ["FSDPBackend", "create_backend"]
