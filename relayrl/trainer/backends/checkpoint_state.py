"""The trainer state file every backend writes last into a checkpoint: its presence marks the checkpoint complete."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from relayrl.runtime.files import atomic_write


def write_trainer_state(directory: Path, trainer_state: dict) -> None:
    """Collective: after every rank's shards are written, rank 0 writes trainer_state.json atomically and durably
    (``atomic_write``: fsynced, renamed into place, the directory fsynced), so a checkpoint that counts as complete
    survives a lost host."""
    dist.barrier()
    if dist.get_rank() == 0:
        atomic_write(directory / "trainer_state.json", json.dumps(trainer_state))
    dist.barrier()
