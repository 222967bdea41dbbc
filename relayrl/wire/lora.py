"""The wire's LoRA adapter shape, shared by the trainer that publishes an adapter and the engines that load it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraAdapterSpec:
    """A LoRA adapter's shape (``common_pb2.LoraSpec``): delta W = scale * B @ A with scale alpha / rank, or
    alpha / sqrt(rank) with rsLoRA (PEFT's LoraConfig)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    def peft_config(self) -> dict:
        """The adapter's ``adapter_config.json`` as PEFT writes it (the fields vLLM's ``PEFTHelper`` and SGLang's
        ``LoRAConfig`` read)."""
        return {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
            "bias": "none",
        }
