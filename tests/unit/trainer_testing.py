"""Helpers shared by the trainer-backend tests (test_train_step.py, test_stream_step.py, test_fsdp_backend.py)."""

from __future__ import annotations

import torch


def full_weights(backend) -> dict[str, torch.Tensor]:
    """Every weight, whole, through the backend's own gather (collective: every rank calls it)."""
    into = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in backend.weight_specs()}
    backend.gather_weights(into)
    return into
