"""The trainer's default group on a GPU pairs gloo (CPU tensors) with NCCL (CUDA tensors): NCCL alone has no
backend for CPU tensors, and every step reduces its metrics as CPU tensors (``StepMetrics.finish``)."""

from __future__ import annotations

from torch.distributed import Backend

from relayrl.trainer.world import world_backend


def test_a_cpu_world_is_gloo() -> None:
    assert world_backend(cuda=False) == "gloo"


def test_a_gpu_world_sends_cpu_tensors_over_gloo_and_cuda_tensors_over_nccl() -> None:
    pairs = dict(pair.split(":") for pair in world_backend(cuda=True).split(","))
    assert pairs == {"cpu": "gloo", "cuda": "nccl"}
    # the upstream fact the pairing rests on (torch/distributed/distributed_c10d.py, Backend.backend_capability)
    assert "cpu" not in Backend.backend_capability["nccl"]
