"""A streamed step (groups trained as they arrive, relayrl/trainer/stream.py) is the whole-batch step.

The same ordered batch, trained whole by ``train_on_batch`` and streamed in arrival chunks through the trainer
loop's ``train_streamed`` (rank 0 relays the parts; ``StreamedStep`` trains them), from the same starting
weights, on 1 and 2 gloo ranks (FSDP2), for token-mean and seq-mean-token-mean, full and partial
(dynamic-sampling-sized) batches, and a stream that breaks after an optimizer step and comes again: the
updated weights and the metrics agree within float rounding.

Tolerance 1e-4 absolute on fp32 weights after two AdamW steps at lr 1e-2, i.e. 1 % of one step's movement:
the two differ only in summation order (chunked forwards, the normaliser applied to the gradient instead of
the loss), ~1e-7 relative, but Adam's first update lr * g / (|g| + eps) turns that into a visible difference
for the few entries whose gradient is near eps (measured: ~2e-5). Loss and metrics: 1e-4.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from trainer_testing import batch_message, full_weights, spawn_ranks, stream_source

from relayrl.config import AlgorithmConfig, ModelConfig, RelayConfig, TrainerConfig, parse_config
from relayrl.runtime.ports import free_port
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.batch import to_train_batch
from relayrl.trainer.loop import train_streamed
from relayrl.trainer.step import train_on_batch
from relayrl.trainer.stream import StreamedStep, read_ahead
from relayrl.v1 import controller_pb2

N, TARGET, PAD = 4, 6, 0
TOLERANCE = 1e-4
CASES = [  # (loss_agg, groups kept, chunk sizes in groups: how the groups arrive, groups before a break)
    ("token-mean", 6, [1, 1, 1, 1, 1, 1], 0),
    ("seq-mean-token-mean", 6, [2, 3, 1], 0),
    ("seq-mean-token-mean", 4, [3, 1], 0),  # partial: dynamic sampling kept 4 of 6
    ("token-mean", 2, [2], 0),  # partial below the first mini-batch
    ("token-mean", 6, [2, 4], 4),  # the stream breaks after 4 groups (one optimizer step taken), then comes again
]


def relay_config(loss_agg: str) -> RelayConfig:
    return parse_config(
        {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "rollout": {"n": N, "max_tokens": 8},
            "controller": {"train_batch_groups": TARGET},
            "trainer": {"lr": 0.01, "mini_batches": 2, "grad_clip": 0.5, "precision": "float32"},
            "algorithm": {"loss_agg": loss_agg},
        }
    )


def compare(model_dir: str, loss_agg: str, groups: int, chunks: list[int], broken: int) -> dict[str, float]:
    """Max |difference| of the weights and of each metric, whole (train_on_batch) vs streamed (the trainer
    loop's train_streamed, rank 0 relaying the parts; after a stream of ``broken`` groups that broke, if any)."""
    cfg = relay_config(loss_agg)
    verified = frozenset({"w0"})
    results = []
    for mode in ("whole", "streamed"):
        backend = FSDPBackend(ModelConfig(path=model_dir), cfg.trainer, with_reference=False)
        before = full_weights(backend)
        batch = batch_message(backend, groups, seed=groups, n=N, target=TARGET)
        if mode == "whole":
            train = to_train_batch(batch, PAD, version=0, verified_workers=verified)
            metrics = train_on_batch(
                backend, train, cfg.algorithm, cfg.trainer, temperature=1.0, norm_len=8,
                minibatch_groups=batch.minibatch_groups,
            )  # fmt: skip
        else:
            parts = stream_source(batch, chunks, broken) if dist.get_rank() == 0 else None
            trained, metrics = train_streamed(backend, cfg, 1, parts, verified, PAD)
            assert list(trained.samples) == list(batch.samples) and metrics["streamed"] == 1.0
        results.append((full_weights(backend), metrics))
    (w_whole, m_whole), (w_streamed, m_streamed) = results
    out = {"weights": max(float((w_whole[k] - w_streamed[k]).abs().max()) for k in w_whole)}
    out["moved"] = max(float((w_whole[k] - before[k]).abs().max()) for k in w_whole)  # not vacuous
    out |= {k: abs(m_whole[k] - m_streamed[k]) for k in m_whole}
    return out


def run_cases(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        diffs = [compare(model_dir, *case) for case in CASES]
        inexact = inexact_error(model_dir)  # collective (the backend's setup): every rank
        if rank == 0:
            Path(out).write_text(json.dumps({"diffs": diffs, "inexact": inexact}))
    finally:
        dist.destroy_process_group()


def inexact_error(model_dir: str) -> str:
    """The error of a stream holding a sample from a worker outside the step's verified publish."""
    tcfg = TrainerConfig(lr=0.01, mini_batches=2, precision="float32")
    backend = FSDPBackend(ModelConfig(path=model_dir), tcfg, with_reference=False)
    batch = batch_message(backend, 2, seed=1, n=N, target=TARGET)
    batch.samples[5].worker_id = "joiner"  # synced outside the step's verified publish
    step = StreamedStep(
        backend, AlgorithmConfig(), tcfg, target_groups=TARGET, version=0, verified=frozenset({"w0"}),
        pad_id=PAD, norm_len=8,
    )  # fmt: skip
    try:
        step.add(list(batch.samples), 1.0)
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("world", [1, 2])
def test_streamed_step_is_the_whole_batch_step(tiny_model_dir, tmp_path, world) -> None:
    out = tmp_path / "diffs.json"
    spawn_ranks(run_cases, (world, free_port(), str(tiny_model_dir), str(out)), world)
    result = json.loads(out.read_text())
    for case, diffs in zip(CASES, result["diffs"], strict=True):
        assert diffs["weights"] < TOLERANCE < diffs["moved"] / 50, (case, diffs)
        for name in ("loss", "grad_norm", "clip_frac", "entropy", "ppo_kl", "logprob_mismatch"):
            assert diffs[name] < 1e-4, (case, name, diffs)
        assert diffs["old_logprobs_from_engine"] == 0, case
    # a sample that is not exactly on-policy is never trained silently
    assert "not generated by the verified weights of version 0" in result["inexact"]


def test_parts_read_while_the_trainer_was_busy_come_as_one_chunk() -> None:
    """read_ahead: the parts that arrived while the first one trained reach the trainer as one part (their samples
    in order), the end comes after them, and the end's callback ran as soon as the end was read."""
    training, queued, release, ended = threading.Event(), threading.Event(), threading.Event(), []
    samples = [controller_pb2.Sample(prompt_id=f"p{g}", group=g) for g in range(4)]

    def items():
        for sample in samples:
            yield "part", controller_pb2.BatchPart(samples=[sample], streamed=True, temperature=0.7).SerializeToString()
            training.wait(10)  # the first part is with the trainer
        queued.set()  # the pump asks for the next item once the last part is in its queue
        release.wait(10)
        yield "end", b"header"

    source = read_ahead(items(), lambda: ended.append(True))
    first = controller_pb2.BatchPart.FromString(next(source)[1])
    training.set()
    assert [s.prompt_id for s in first.samples] == ["p0"] and queued.wait(10)
    kind, payload = next(source)
    part = controller_pb2.BatchPart.FromString(payload)
    assert kind == "part" and [s.prompt_id for s in part.samples] == ["p1", "p2", "p3"], part
    assert part.streamed and part.temperature == pytest.approx(0.7) and not ended
    release.set()
    assert next(source) == ("end", b"header") and ended == [True]
    assert list(source) == []
