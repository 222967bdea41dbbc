"""LoRA adapters served by the hf engine, unmerged: every adapted Linear computes

    y = W x + b + scale * B (A x)        (scale = alpha / r, or alpha / sqrt(r) with rsLoRA)

in the order PEFT's ``lora.Linear.forward`` does (``result + lora_B(lora_A(x)) * scaling``), so the engine's
logprobs are the trainer's up to float rounding; W is never touched, so nothing drifts however many adapters are
loaded (a merge W + scale B A followed by an unmerge does not give W back in floating point).

An adapter lives as a plain attribute (``LORA_ATTR``) of each adapted module: the transformers forward applies it
in a forward hook, the fast decode runner reads it in ``llama_decode._linear``. Loading checks everything first
(every tensor names a Linear of the model, A and B both there, shapes [r, in] and [out, r]) and only then swaps
the attributes, so a bad adapter raises and the previous one keeps serving. The caller holds generation back
during ``load`` (rows of one decode step must see one adapter).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from relayrl.wire.lora import LoraAdapterSpec

LORA_ATTR = "relayrl_lora"
PEFT_PREFIX = "base_model.model."
SUFFIXES = {".lora_A.weight": "a", ".lora_B.weight": "b"}


@dataclass(frozen=True)
class ModuleAdapter:
    """One adapted Linear's A [r, in], B [out, r] and scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + B (A x) * scale (PEFT's order)."""
        return out + F.linear(F.linear(x, self.a), self.b) * self.scale


def adapted_modules(names: list[str] | Mapping[str, object]) -> dict[str, dict[str, str]]:
    """Adapter tensor names (PEFT's saved names) -> {module path: {"a": name, "b": name}}; ValueError naming a
    tensor that is not a ``lora_A``/``lora_B`` weight."""
    modules: dict[str, dict[str, str]] = {}
    for name in names:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{name[:200]}: not a LoRA weight (expected ...lora_A.weight or ...lora_B.weight)")
        module = name.removeprefix(PEFT_PREFIX).removesuffix(suffix)
        modules.setdefault(module, {})[SUFFIXES[suffix]] = name
    return modules


def _hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    adapter = module.__dict__.get(LORA_ATTR)
    return out if adapter is None else adapter.add_to(out, args[0])


class AdapterSlots:
    """The adapter a model serves (none at first): ``load`` replaces it as a whole."""

    def __init__(self, model: nn.Module) -> None:
        self.linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
        self.active: dict[str, ModuleAdapter] = {}
        self.name = ""
        self._hooked: set[str] = set()

    def load(self, name: str, spec: LoraAdapterSpec, tensors: Mapping[str, torch.Tensor]) -> int:
        """Serve adapter ``name`` from ``tensors`` (PEFT's saved names); returns how many modules it adapts.
        ValueError, before anything changes, for an empty adapter, a tensor matching no Linear of the model, a
        module without both A and B, or a shape that is not [rank, in] / [out, rank]."""
        modules = adapted_modules(tensors)
        if not modules:
            raise ValueError(f"adapter {name}: no tensors (it would serve the base model)")
        staged: dict[str, ModuleAdapter] = {}
        for path, parts in modules.items():
            linear = self.linears.get(path)
            if linear is None:
                raise ValueError(f"{path[:200]}: no Linear module of that name in the model")
            if set(parts) != {"a", "b"}:
                raise ValueError(f"{path[:200]}: lora_A and lora_B must both be sent")
            a, b = tensors[parts["a"]], tensors[parts["b"]]
            want_a, want_b = (spec.rank, linear.in_features), (linear.out_features, spec.rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ValueError(
                    f"{path[:200]}: lora_A {list(a.shape)} / lora_B {list(b.shape)}, expected {list(want_a)} / "
                    f"{list(want_b)} (rank {spec.rank})"
                )
            w = linear.weight
            staged[path] = ModuleAdapter(a.to(w.device, w.dtype), b.to(w.device, w.dtype), spec.scale)
        for path in self.active.keys() - staged.keys():
            del self.linears[path].__dict__[LORA_ATTR]
        for path, adapter in staged.items():
            self.linears[path].__dict__[LORA_ATTR] = adapter
            if path not in self._hooked:
                self.linears[path].register_forward_hook(_hook)
                self._hooked.add(path)
        self.active, self.name = staged, name
        return len(staged)
