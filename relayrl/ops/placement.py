"""GPU placement on one node: which devices each child of ``relayrl up`` sees (``CUDA_VISIBLE_DEVICES``).

Rollout workers come first, each with as many devices as its engine spans (vLLM
``tensor_parallel_size x pipeline_parallel_size``, SGLang ``tp_size x pp_size``, hf 1); the trainer gets the
next ``trainer.nproc`` devices, one per rank. Devices are the node's physical ids, or the ids the launcher's
own ``CUDA_VISIBLE_DEVICES`` lists. A config that needs more than the node has is refused with the numbers.
"""

from __future__ import annotations

import os

from relayrl.config import ConfigError, RelayConfig, RolloutConfig

# What a GPU runtime needs on the host before torch.cuda can count a device: NVIDIA's control node, AMD's
# ROCm kernel driver (HIP), WSL2's GPU paravirtualisation. ``relayrl up`` on a machine with none of them
# (every CPU run) places nothing without importing torch (seconds before the first role could start).
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")

PARALLEL_OPTIONS = {
    "vllm": ("tensor_parallel_size", "pipeline_parallel_size"),
    "sglang": ("tp_size", "pp_size"),
    "hf": (),
}


def gpus_per_worker(rollout: RolloutConfig) -> int:
    """Devices one rollout worker's engine spans: the product of its parallel sizes (1 without any)."""
    count = 1
    for key in PARALLEL_OPTIONS[rollout.engine]:
        count *= int(rollout.engine_options.get(key, 1))
    return count


def node_devices(configured: int | None) -> list[str]:
    """The device ids children may be given: ``configured`` of them, or what this process sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    if configured is not None:
        return (ids or [str(i) for i in range(configured)])[:configured]
    if ids is not None:
        return ids
    if not any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        return []  # no GPU driver: torch could not see a device either, and importing it costs seconds
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def place(cfg: RelayConfig, devices: list[str]) -> dict[str, str]:
    """role -> CUDA_VISIBLE_DEVICES for ``rollout-<k>`` (k < rollout.workers) and ``trainer``; {} without devices.

    Raises ConfigError when workers x per-worker devices + trainer ranks exceed ``len(devices)``."""
    if not devices:
        return {}
    per_worker, workers, ranks = gpus_per_worker(cfg.rollout), cfg.rollout.workers, cfg.trainer.nproc
    needed = workers * per_worker + ranks
    if needed > len(devices):
        raise ConfigError(
            f"supervisor.gpus: the run needs {needed} GPUs ({workers} rollout workers x {per_worker} "
            f"+ {ranks} trainer ranks) but the node has {len(devices)}"
        )
    plan = {f"rollout-{k}": ",".join(devices[k * per_worker : (k + 1) * per_worker]) for k in range(workers)}
    plan["trainer"] = ",".join(devices[workers * per_worker : needed])
    return plan
