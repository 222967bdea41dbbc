"""LoRA on the FSDP backend (``model.lora``): PEFT's LoraConfig applied to the policy, and the names weight sync
and the export use.

PEFT wraps the model, so its parameters are named ``base_model.model.<module>.base_layer.weight`` (an adapted
module's frozen weight), ``base_model.model.<name>`` (every other frozen weight) and
``base_model.model.<module>.lora_A.default.weight`` (the adapter). On the wire (``WeightManifest.kind``):
- ``base``: the Hugging Face name every engine loads (``model.layers.0.self_attn.q_proj.weight``);
- ``adapter``: PEFT's saved name, the adapter's name dropped (``base_model.model.model.layers.0.self_attn.q_proj.
  lora_A.weight``), as in a PEFT adapter directory's adapter_model.safetensors.
PEFT initialises B to zero, so the adapted policy at step 0 is the base model itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from relayrl.config import LoraConfig
from relayrl.wire.lora import LoraAdapterSpec

if TYPE_CHECKING:  # peft is imported where it is used: it costs every trainer's start-up ~0.8 s of CPU otherwise
    import peft

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # PEFT's name of the one adapter
ADAPTER_FILE = "adapter_model.safetensors"


def peft_config(cfg: LoraConfig, base_path: str = "") -> peft.LoraConfig:
    """``model.lora`` as PEFT's LoraConfig for a causal LM (no bias trained)."""
    import peft

    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        target_modules=list(cfg.target_modules),
        lora_dropout=cfg.dropout,
        use_rslora=cfg.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_path or None,
    )


def lora_spec(cfg: LoraConfig) -> LoraAdapterSpec:
    """The adapter's shape as manifests and engines state it."""
    return LoraAdapterSpec(cfg.rank, cfg.alpha, tuple(cfg.target_modules), cfg.use_rslora)


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> peft.PeftModel:
    """``model`` wrapped by PEFT: every weight frozen but the adapter's. ValueError naming ``model.lora.
    target_modules`` when no module matches (an adapter on nothing would train nothing)."""
    import peft

    try:
        return peft.get_peft_model(model, peft_config(cfg))
    except ValueError as err:
        raise ValueError(f"model.lora.target_modules: {cfg.target_modules} match no module: {err}") from None


def is_adapter(name: str) -> bool:
    """A PEFT parameter name that belongs to the adapter."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """PEFT parameter name -> the Hugging Face name of that base weight."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_name(name: str) -> str:
    """PEFT parameter name -> its name in a saved adapter (``.lora_A.default.weight`` -> ``.lora_A.weight``)."""
    return name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")


def write_adapter(directory: Path, cfg: LoraConfig, base_path: str, tensors: dict[str, torch.Tensor]) -> None:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) from the adapter's tensors
    under their saved names: ``peft.PeftModel.from_pretrained(base, directory)`` loads it."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(directory / ADAPTER_FILE))
    peft_config(cfg, base_path).save_pretrained(str(directory))


def write_merged(directory: Path, base_path: str, adapter_dir: Path, dtype: torch.dtype) -> None:
    """The base model with the adapter of ``adapter_dir`` merged in (W + scale * B A, by PEFT), as a Hugging
    Face model directory."""
    import peft

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    merged = peft.PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(directory)
