"""Which dtypes a role computes in: ``trainer.precision``, ``trainer.reference_dtype``, ``rollout.weight_dtype``.

"auto" picks bfloat16 where the hardware multiplies it fast, float32 elsewhere (``bf16_fast``):
- a CUDA device with native bf16 (``torch.cuda.is_bf16_supported()``, compute capability >= 8: tensor cores);
- a CPU with AMX-BF16 or AVX512-BF16 (``amx_bf16`` / ``avx512_bf16`` in /proc/cpuinfo's flags, or torch's
  dispatch capability ``AMX``): oneDNN runs bf16 matmuls on them, elsewhere it emulates them, slower than float32.
The reference model and the engine's weights follow the trainer's compute dtype when "auto".
Parameters and optimizer state are float32 whatever these say (relayrl/trainer/precision.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(
        flag for line in text.splitlines() if line.startswith("flags") for flag in line.partition(":")[2].split()
    )


def bf16_fast(device_type: str) -> tuple[bool, str]:
    """Whether bf16 matmuls run natively (and faster than float32) on ``device_type`` ("cpu" / "cuda"), and why."""
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        fast = torch.cuda.is_bf16_supported(including_emulation=False) and major >= 8
        return fast, f"CUDA compute capability {major}.{minor}" + (" (bf16 tensor cores)" if fast else " (no bf16)")
    found = [flag for flag in CPU_BF16_FLAGS if flag in cpu_flags()]
    if not found and torch.backends.cpu.get_cpu_capability() == "AMX":
        found = ["AMX"]
    return bool(found), f"CPU {'/'.join(found)}" if found else "CPU without AMX-BF16 or AVX512-BF16"


def compute_dtype(setting: str, device_type: str) -> tuple[torch.dtype, str]:
    """``trainer.precision`` (auto / float32 / bfloat16) on ``device_type``: the dtype and why it was chosen."""
    if setting != "auto":
        return DTYPES[setting], "set"
    fast, why = bf16_fast(device_type)
    return (torch.bfloat16 if fast else torch.float32), f"auto: {why}"


def follow(setting: str, compute: torch.dtype) -> torch.dtype:
    """A dtype key that follows the compute dtype when "auto" (``trainer.reference_dtype``,
    ``rollout.weight_dtype``)."""
    return compute if setting == "auto" else DTYPES[setting]


def engine_dtype_name(weight_dtype: str, precision: str, device_type: str) -> str:
    """The engine's weight dtype as a name (what ``create_engine(dtype=)`` takes): ``rollout.weight_dtype``, or
    with "auto" the trainer's compute dtype (``trainer.precision``) as resolved on this machine."""
    dtype = follow(weight_dtype, compute_dtype(precision, device_type)[0])
    return str(dtype).removeprefix("torch.")
