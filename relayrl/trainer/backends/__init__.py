"""Training backends: how the policy is sharded, stepped, gathered and checkpointed.

Both expose the same interface to the training step: ``device``, ``weight_names``, ``dp_rank``/``dp_size``
(the data-parallel rank and size the step shards rows by), ``logprobs`` (its ``scored`` positions, the loss's, the
only ones a backend must compute), ``step``,
``weight_specs``, ``gather_weights``, ``save_checkpoint``, ``load_checkpoint``, ``export_hf``, and ``lora`` (the
adapter's spec when ``model.lora`` trains one, FSDP only: then ``weight_specs``/``gather_weights`` take a ``kind``,
"base" or "adapter"; else None), ``critic`` (the value model under ``algorithm.advantage: gae``, FSDP only;
else None), and ``precision`` (relayrl/trainer/precision.py: float32 parameters and optimizer state, the compute
dtype, the reference model's and the engine's; ``weight_specs`` reports the engine's dtype). A second trained
model (the critic) loads as the policy does: ``fsdp.load_trained_model`` with the backend's ``precision``.
"""

from __future__ import annotations

from relayrl.config import CriticConfig, ModelConfig, TrainerConfig
from relayrl.trainer.backends.critic import FSDPCritic
from relayrl.trainer.backends.fsdp import FSDPBackend


def create_backend(
    model_cfg: ModelConfig,
    cfg: TrainerConfig,
    *,
    with_reference: bool,
    critic: CriticConfig | None = None,
    weight_dtype: str = "auto",
):
    """The backend ``cfg.backend`` names (Megatron-core is imported only when chosen: an optional extra), with a
    value model as ``backend.critic`` where ``critic`` is given (FSDP only: the config refuses it elsewhere);
    ``weight_dtype``: ``rollout.weight_dtype``, the engine's."""
    if cfg.backend == "megatron":
        try:
            from relayrl.trainer.backends.megatron import MegatronBackend
        except ImportError as err:
            raise ImportError(
                f"trainer.backend: megatron needs megatron-core (pip install 'relayrl[megatron]'): {err}"
            ) from err
        return MegatronBackend(model_cfg, cfg, with_reference=with_reference, weight_dtype=weight_dtype)
    backend = FSDPBackend(model_cfg, cfg, with_reference=with_reference, weight_dtype=weight_dtype)
    if critic is not None:
        backend.critic = FSDPCritic(critic, model_cfg, cfg, backend.device, backend.precision)
    return backend


__all__ = ["FSDPBackend", "create_backend"]
