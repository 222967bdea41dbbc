"""The rollout correction in the trainer's step (relayrl/algorithms/rollout_correction.py; docs/algorithms.md,
"Rollout correction"): which log-probs it reads in each mode, its collectives over the data-parallel ranks (the
kept-token counts of the denominators, the batch mean of normalised weights), and its per-step diagnostics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from relayrl.algorithms.rollout_correction import (
    APPLIED_SUMS,
    DIAGNOSTIC_SUMS,
    Correction,
    applied_metrics,
    applied_sums,
    apply_correction,
    diagnostic_metrics,
    diagnostic_sums,
    normalised,
    weight_sums,
)
from relayrl.config import CORRECTION_PREFIX, AlgorithmConfig
from relayrl.trainer.batch import TrainBatch

EXTREMA = ("_max", "_min")


def dp_sum(values: torch.Tensor, backend) -> torch.Tensor:
    """``values`` summed over the data-parallel ranks (collective over the world: each model replica's ranks hold
    the same values, so the world's sum is divided by the ranks per replica)."""
    out = values.detach().double().cpu().clone()
    if dist.get_world_size() > 1:
        dist.all_reduce(out)
    return out / (dist.get_world_size() // backend.dp_size)


def kept_row_tokens(kept: torch.Tensor, shard: torch.Tensor, rows: int, backend) -> torch.Tensor:
    """[rows]: each row's loss tokens left after the rollout correction, the whole batch's (every rank's shard;
    collective). The denominators of agg_loss count these: a rejected token counts nowhere."""
    tokens = torch.zeros(rows, dtype=torch.float64)
    tokens[shard] = kept.sum(-1).double().cpu()
    return dp_sum(tokens, backend)


def correct_rows(
    backend,
    batch: TrainBatch,
    shard: torch.Tensor,
    m: torch.Tensor,
    old: torch.Tensor,
    current: torch.Tensor,
    alg: AlgorithmConfig,
    engine_old: bool,
) -> Correction:
    """The rollout correction of rows ``shard`` (relayrl/algorithms/rollout_correction.py) against each token's own
    engine log-prob: IS weights from the proximal policy ``old``; rejection from the trainer's log-probs, ``old``
    in decoupled mode, this forward's (``current``) where ``old`` is the engine's (bypass: docs/algorithms.md).
    Batch normalisation divides by the weights' mean over every rank's rows (collective)."""
    rc = alg.correction
    behaviour = batch.rollout_logprobs[shard].to(backend.device)
    correction = apply_correction(rc, proximal=old, behaviour=behaviour, trainer=current if engine_old else old, mask=m)
    if rc.rollout_is is not None and rc.rollout_is_batch_normalize:
        correction = normalised(correction, dp_sum(weight_sums(correction, rc.rollout_is), backend))
    return correction


class Tally:
    """Named statistics of a step's rows as they come, reduced over ranks once: a ``*_max`` / ``*_min`` key keeps
    the largest / smallest value, any other adds up (float64). Every rank holds every key, so the reduction's
    collectives match; a max or min nothing reached reads 0."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)
        self.values = torch.tensor([self._start(k) for k in self.keys], dtype=torch.float64)

    @staticmethod
    def _start(key: str) -> float:
        return -math.inf if key.endswith("_max") else math.inf if key.endswith("_min") else 0.0

    def add(self, sums: dict[str, torch.Tensor]) -> None:
        for i, key in enumerate(self.keys):
            value = float(sums[key])
            if key.endswith("_max"):
                self.values[i] = max(float(self.values[i]), value)
            elif key.endswith("_min"):
                self.values[i] = min(float(self.values[i]), value)
            else:
                self.values[i] += value

    def reduce(self) -> dict[str, float]:
        """Collective over the trainer's world."""
        for suffix, op in (("_max", dist.ReduceOp.MAX), ("_min", dist.ReduceOp.MIN), ("", dist.ReduceOp.SUM)):
            picked = [i for i, k in enumerate(self.keys) if k.endswith(suffix) and (suffix or not k.endswith(EXTREMA))]
            part = self.values[picked].clone()
            dist.all_reduce(part, op=op)
            self.values[picked] = part
        return {k: float(v) if math.isfinite(float(v)) else 0.0 for k, v in zip(self.keys, self.values, strict=True)}


class CorrectionMetrics:
    """A step's ``rollout_corr/*`` metrics: the mismatch where the trainer's log-probs at the step's starting
    weights are known (``add_mismatch``), and what the correction kept and weighed on the first pass over the batch
    (``add_applied``); ``finish`` reduces them over ranks (collective)."""

    def __init__(self) -> None:
        self.mismatch = Tally([*DIAGNOSTIC_SUMS, "ratio_max", "ratio_min"])
        self.applied = Tally([*APPLIED_SUMS, "weight_max", "weight_min"])

    def add_mismatch(self, trainer: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> None:
        self.mismatch.add(diagnostic_sums(trainer, behaviour, mask))

    def add_applied(self, pieces: dict) -> None:
        """``pieces`` of ``backward_rows``: its correction and the rows' response mask."""
        self.applied.add(applied_sums(pieces["correction"], pieces["response_mask"]))

    def finish(self) -> dict[str, float]:
        out = diagnostic_metrics(self.mismatch.reduce()) | applied_metrics(self.applied.reduce())
        return {CORRECTION_PREFIX + name: value for name, value in out.items()}
