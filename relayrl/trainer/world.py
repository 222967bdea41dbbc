"""The trainer ranks' default process group, safe across torchrun's in-place restarts.

torchrun ``--max-restarts`` restarts every rank of a node on one rank's death and hands the new attempt
the agent's TCP store, the one the dead attempt used (``TORCHELASTIC_USE_AGENT_STORE``; torch 2.13,
``torch/distributed/rendezvous.py::_create_c10d_store`` assumes a fresh store per retry and adds no
prefix). Gloo's full-mesh connect then reads the dead ranks' listening addresses under the same keys:
with the static rendezvous (``--master-addr/--master-port``) the new attempt hangs in
``init_process_group``, with ``c10d`` it fails with "Connection refused" and burns a restart. Every
attempt here gets its own key space, ``relayrl/attempt-{TORCHELASTIC_RESTART_COUNT}``.

On CUDA the group is ``cpu:gloo,cuda:nccl``: ``nccl`` alone registers no backend for CPU tensors
(``torch/distributed/distributed_c10d.py``, ``Backend.backend_capability``), and the step's metrics are
reduced as CPU tensors; object collectives then run on gloo too, with no device copy.
"""

from __future__ import annotations

import os

import torch.distributed as dist


def restart_attempt() -> int:
    """How many times torchrun has restarted this rank's node (0 on the first start, and outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def world_backend(cuda: bool) -> str:
    """The default group's backend: gloo on CPU; gloo for CPU tensors and NCCL for CUDA ones on a GPU."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def init_world(backend: str) -> None:
    """``init_process_group(backend)`` from the ``env://`` rendezvous, its keys prefixed by the attempt."""
    store, rank, world_size = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"relayrl/attempt-{restart_attempt()}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
