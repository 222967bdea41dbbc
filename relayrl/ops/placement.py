"""GPU placement on one node: which devices each child of ``relayrl up`` sees (``CUDA_VISIBLE_DEVICES``).

Rollout workers come first, each with as many devices as its engine spans (vLLM
``tensor_parallel_size x pipeline_parallel_size``, SGLang ``tp_size x pp_size``, hf 1); the trainer gets the
next ``trainer.nproc`` devices, one per rank; then each scorer replica ``relayrl up`` starts, as many as its engine
spans (a judge on vLLM/SGLang: its parallel sizes; a classifier, a teacher, an hf judge: 1). Scorers come last so
a run without them is placed as before. Devices are the node's physical ids, or the ids the launcher's own
``CUDA_VISIBLE_DEVICES`` lists. A config that needs more than the node has is refused with the numbers; a replica
started later (``relayrl scale reward N``) gets devices no role holds (``claim``), or is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from relayrl.config import ConfigError, RelayConfig, ScorerConfig

# What a GPU runtime needs on the host before torch.cuda can count a device: NVIDIA's control node, AMD's
# ROCm kernel driver (HIP), WSL2's GPU paravirtualisation. ``relayrl up`` on a machine with none of them
# (every CPU run) places nothing without importing torch (seconds before the first role could start).
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")

PARALLEL_OPTIONS = {
    "vllm": ("tensor_parallel_size", "pipeline_parallel_size"),
    "sglang": ("tp_size", "pp_size"),
    "hf": (),
}


SCORER_ROLE_PREFIX = "reward-"


def scorer_role(name: str, index: int) -> str:
    """The role of replica ``index`` of scorer ``name``: ``reward-<name>-<index>``."""
    return f"{SCORER_ROLE_PREFIX}{name}-{index}"


def scorer_roles(cfg: RelayConfig) -> dict[str, tuple[str, int]]:
    """role -> (scorer name, replica index) of every scorer replica ``relayrl up`` starts."""
    return {scorer_role(name, i): (name, i) for name, s in cfg.scorers.items() for i in range(s.replicas)}


def engine_gpus(engine: str, options: Mapping[str, Any]) -> int:
    """Devices one engine spans (a rollout worker's, a judge's): the product of its parallel sizes in ``options``
    (1 without any; hf, a classifier and a teacher: 1)."""
    count = 1
    for key in PARALLEL_OPTIONS[engine]:
        count *= int(options.get(key, 1))
    return count


def scorer_gpus(scorer: ScorerConfig) -> int:
    """Devices one replica of ``scorer`` spans (``engine_gpus`` of its engine and engine_options)."""
    return engine_gpus(scorer.engine, scorer.engine_options)


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
    """role -> CUDA_VISIBLE_DEVICES for ``rollout-<k>`` (k < rollout.workers), ``trainer`` and each scorer replica
    ``reward-<name>-<i>`` (i < scorers.<name>.replicas), in that order; {} without devices.

    Raises ConfigError when workers x per-worker devices + trainer ranks + replicas x per-replica devices exceed
    ``len(devices)``."""
    if not devices:
        return {}
    workers, ranks = cfg.rollout.workers, cfg.trainer.nproc
    per_worker = engine_gpus(cfg.rollout.engine, cfg.rollout.engine_options)
    sizes = {f"rollout-{k}": per_worker for k in range(workers)} | {"trainer": ranks}
    sizes |= {role: scorer_gpus(cfg.scorers[name]) for role, (name, _) in scorer_roles(cfg).items()}
    needed = sum(sizes.values())
    if needed > len(devices):
        replicas = [(name, s.replicas, scorer_gpus(s)) for name, s in cfg.scorers.items() if s.replicas]
        scorers = "".join(f" + {r} scorers.{name} replicas x {each}" for name, r, each in replicas)
        raise ConfigError(
            f"supervisor.gpus: the run needs {needed} GPUs ({workers} rollout workers x {per_worker} "
            f"+ {ranks} trainer ranks{scorers}) but the node has {len(devices)}"
        )
    plan, start = {}, 0
    for role, size in sizes.items():
        plan[role], start = ",".join(devices[start : start + size]), start + size
    return plan


def claim(plan: dict[str, str], devices: list[str], role: str, count: int) -> str:
    """The first ``count`` of ``devices`` no role of ``plan`` holds, for ``role`` started after ``place`` (a scale-up);
    the caller records them in ``plan`` and drops a stopped role's entry, which frees its devices.

    Raises ConfigError naming supervisor.gpus when fewer are free."""
    held = {d for ids in plan.values() for d in ids.split(",")}
    free = [d for d in devices if d not in held]
    if count > len(free):
        raise ConfigError(
            f"supervisor.gpus: {role} needs {count} GPU{'s' if count > 1 else ''} but {len(free)} of the node's "
            f"{len(devices)} are free"
        )
    return ",".join(free[:count])
