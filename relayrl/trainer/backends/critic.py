"""The value model of PPO with a learned critic (``algorithm.advantage: gae``) on the FSDP backend.

A token-classification model with one label: the backbone of ``critic.path`` (default ``model.path``, the policy's
own checkpoint: relayrl/config.py CriticConfig says why) and a scalar head ``score`` in place of the LM head,
zero-initialised so that every value starts at 0 (GAE then starts as REINFORCE with no baseline, not with a
random one). It is loaded and sharded like the policy (``load_trained_model``: every decoder layer, then the root;
nothing with one rank), holds the policy's precision (float32 parameters and AdamW state, its compute dtype), and
has its own AdamW (``critic.lr``, ``weight_decay``; ``trainer.betas``) and gradient clip.

Position t of ``values`` is V of the prefix up to token t: the state in which token t+1 is sampled, the position
that scores token t+1 in ``TrainBatch``. Forwards are padded (the critic does not take the padding-free path).
Contract: every method is called by every rank (they hold collectives).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from transformers import AutoConfig, AutoModelForTokenClassification

from relayrl.config import CriticConfig, ModelConfig, TrainerConfig
from relayrl.trainer.backends.fsdp import load_trained_model
from relayrl.trainer.batch import right_padded
from relayrl.trainer.precision import Precision


def load_value_model(
    path: str, precision: Precision, device: torch.device, *, gradient_checkpointing: bool = False
) -> torch.nn.Module:
    """``path``'s backbone with a zero scalar head (no dropout before it), trainable, loaded as the policy is
    (``load_trained_model``: float32 parameters, sharded over >1 ranks under ``precision``'s policy, each layer
    recomputed in the backward with ``gradient_checkpointing``)."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # the generic head's default is 0.1: values would be noisy in training mode

    def loader(path: str, dtype: torch.dtype) -> torch.nn.Module:
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)
        with torch.no_grad():
            model.score.weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
        return model

    return load_trained_model(path, precision, device, gradient_checkpointing=gradient_checkpointing, loader=loader)


class FSDPCritic:
    def __init__(
        self,
        critic_cfg: CriticConfig,
        model_cfg: ModelConfig,
        cfg: TrainerConfig,
        device: torch.device,
        precision: Precision,
    ):
        """``precision``: the policy backend's (relayrl/trainer/precision.py): float32 parameters and AdamW state,
        its compute dtype."""
        self.device, self.precision = device, precision
        self.grad_clip = critic_cfg.grad_clip
        self.model = load_value_model(
            critic_cfg.path or model_cfg.path, precision, device, gradient_checkpointing=cfg.gradient_checkpointing
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=critic_cfg.lr, betas=cfg.betas, weight_decay=critic_cfg.weight_decay, fused=True
        )

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """V per position, [B, L-1] float32 (position t: the prefix up to token t). A right-padded batch goes in
        without its mask (causal attention never looks right: the valid positions are the same)."""
        mask = None if right_padded(attention_mask) else attention_mask.to(self.device)
        with self.precision.autocast(self.device):
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask).logits
        return out[:, :-1, 0].float()

    def step(self) -> float:
        """Clip the critic's gradient norm to ``critic.grad_clip``, step, zero the gradients; the pre-clip norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def state_dicts(self) -> tuple[dict, dict]:
        """(model, optimizer) state dicts as torch.distributed.checkpoint saves and loads them (sharded)."""
        return get_state_dict(self.model, self.optimizer)

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def digest(self) -> str:
        """sha256 over the full weights and optimizer state (``state_digest``), the same on every rank."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        return state_digest({"critic": model_sd, "critic_optim": optim_sd})

    def export_hf(self, directory: Path, tokenizer) -> None:
        """A Hugging Face token-classification directory (one label: the value), rank 0 writes; collective."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            config = self.model.config
            model = AutoModelForTokenClassification.from_config(config, dtype=next(iter(state.values())).dtype)
            model.load_state_dict(state)
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
        dist.barrier()


def state_digest(state: dict) -> str:
    """sha256 of every tensor of a nested state dict, in sorted dotted-key order, with its key, dtype, shape and
    bytes (so two states with one flipped bit differ). Non-tensor leaves (an optimizer's hyper-parameters) are
    left out: only what training writes is compared."""
    leaves: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(f"{prefix}.{i}", value)
        elif isinstance(node, torch.Tensor):
            leaves[prefix] = node

    walk("", state)
    h = hashlib.sha256()
    for key in sorted(leaves):
        t = leaves[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
