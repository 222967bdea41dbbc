"""The trainer state file every backend writes last into a checkpoint: its presence marks the checkpoint complete."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist


def write_trainer_state(directory: Path, trainer_state: dict) -> None:
    """Collective: after every rank's shards are written, rank 0 writes trainer_state.json atomically."""
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = directory / "trainer_state.json.tmp"
        tmp.write_text(json.dumps(trainer_state))
        tmp.replace(directory / "trainer_state.json")
    dist.barrier()
