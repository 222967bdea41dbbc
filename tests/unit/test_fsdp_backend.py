"""The FSDP backend's world of one rank trains the plain module: the same update as fully_shard, and its
checkpoints resume on two ranks (sharded) and back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from trainer_testing import full_weights, rollout_batch, spawn_ranks

from relayrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from relayrl.runtime.ports import free_port
from relayrl.runtime.procs import exit_now
from relayrl.trainer.backends.fsdp import FSDPBackend, shard
from relayrl.trainer.step import train_on_batch

TCFG = TrainerConfig(lr=0.01, mini_batches=2, precision="float32")  # one rank and two agree to float rounding
ALG = AlgorithmConfig(old_logprobs="recompute")
TOLERANCE = 1e-5


def train(backend: FSDPBackend, seed: int) -> dict[str, float]:
    """One step on ``seed``'s batch; its old logprobs are recomputed, so the rollout ones play no part."""
    return train_on_batch(backend, rollout_batch(backend, seed=seed), ALG, TCFG, temperature=1.0, norm_len=7)


def is_sharded(backend: FSDPBackend) -> bool:
    return all(isinstance(p, DTensor) for p in backend.model.parameters())


def one_rank_cases(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """The plain module against the same model fully_shard'ed, both one step on one batch, in a world of one."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        plain = FSDPBackend(ModelConfig(path=model_dir), TCFG, with_reference=False)
        sharded = FSDPBackend(ModelConfig(path=model_dir), TCFG, with_reference=False)
        shard(sharded.model)
        sharded.optimizer = torch.optim.AdamW(
            sharded.model.parameters(), lr=TCFG.lr, betas=TCFG.betas, weight_decay=TCFG.weight_decay
        )
        before = full_weights(plain)
        metrics = [train(backend, seed=0) for backend in (plain, sharded)]
        w_plain, w_sharded = full_weights(plain), full_weights(sharded)
        result = {
            "plain_sharded": is_sharded(plain), "sharded_sharded": is_sharded(sharded),
            "weights": max(float((w_plain[k] - w_sharded[k]).abs().max()) for k in w_plain),
            "moved": max(float((w_plain[k] - before[k]).abs().max()) for k in w_plain),
            "loss": abs(metrics[0]["loss"] - metrics[1]["loss"]),
        }  # fmt: skip
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_now(0)


def layer_calls(backend: FSDPBackend) -> list[int]:
    """A counter of the first decoder layer's MLP forward calls (a recomputation in the backward is one more; the
    recomputation runs no forward hooks, so the count wraps the forward itself)."""
    calls, mlp = [0], backend.model.model.layers[0].mlp
    forward = mlp.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    mlp.forward = counted
    return calls


def gradient_checkpointing_case(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """The plain module against the same model fully_shard'ed with trainer.gradient_checkpointing, one step each."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        plain = FSDPBackend(ModelConfig(path=model_dir), TCFG, with_reference=False)
        checkpointed_cfg = TCFG.model_copy(update={"gradient_checkpointing": True})
        checkpointed = FSDPBackend(ModelConfig(path=model_dir), checkpointed_cfg, with_reference=False)
        shard(checkpointed.model)
        checkpointed.optimizer = torch.optim.AdamW(
            checkpointed.model.parameters(), lr=TCFG.lr, betas=TCFG.betas, weight_decay=TCFG.weight_decay
        )
        calls = [layer_calls(backend) for backend in (plain, checkpointed)]
        metrics = [train(backend, seed=0) for backend in (plain, checkpointed)]
        w_plain, w_checkpointed = full_weights(plain), full_weights(checkpointed)
        result = {
            "calls": [c[0] for c in calls],
            "weights": max(float((w_plain[k] - w_checkpointed[k]).abs().max()) for k in w_plain),
            "loss": abs(metrics[0]["loss"] - metrics[1]["loss"]),
            "grad_norm": abs(metrics[0]["grad_norm"] - metrics[1]["grad_norm"]),
        }  # fmt: skip
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_now(0)


def checkpoint_case(rank: int, world: int, port: int, model_dir: str, action: str, ckpt: str, out: str) -> None:
    """``save``: step 1, checkpoint, step 2. ``resume``: load the checkpoint, step 2. Rank 0 writes the weights
    after step 2 (equal only if the weights and the AdamW moments both came back) and whether they are sharded."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        backend = FSDPBackend(ModelConfig(path=model_dir), TCFG, with_reference=False)
        if action == "save":
            train(backend, seed=1)
            backend.save_checkpoint(Path(ckpt), {"step": 1})
        else:
            assert backend.load_checkpoint(Path(ckpt)) == {"step": 1}
        train(backend, seed=2)
        weights = full_weights(backend)
        if rank == 0:
            torch.save({"weights": weights, "sharded": is_sharded(backend)}, out)
    finally:
        dist.destroy_process_group()
    exit_now(0)  # as the trainer exits: gloo's static teardown aborted a finished rank ~1 run in 10


def test_one_rank_trains_the_plain_module_as_fully_shard_would(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "result.json"
    spawn_ranks(one_rank_cases, (1, free_port(), str(tiny_model_dir), str(out)), 1)
    result = json.loads(out.read_text())
    assert not result["plain_sharded"] and result["sharded_sharded"]
    assert result["weights"] < TOLERANCE < result["moved"] / 50, result
    assert result["loss"] < 1e-6, result


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_world_size(tiny_model_dir, tmp_path, saved_on, resumed_on) -> None:
    ckpt = tmp_path / "step_1"
    runs = {}
    for action, world in (("save", saved_on), ("resume", resumed_on)):
        out = tmp_path / f"{action}.pt"
        args = (world, free_port(), str(tiny_model_dir), action, str(ckpt), str(out))
        spawn_ranks(checkpoint_case, args, world)
        runs[action] = torch.load(out)
    assert runs["save"]["sharded"] == (saved_on > 1) and runs["resume"]["sharded"] == (resumed_on > 1)
    for name, tensor in runs["save"]["weights"].items():
        torch.testing.assert_close(runs["resume"]["weights"][name], tensor, atol=TOLERANCE, rtol=0, msg=name)


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_update(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "result.json"
    spawn_ranks(gradient_checkpointing_case, (1, free_port(), str(tiny_model_dir), str(out)), 1)
    result = json.loads(out.read_text())
    plain_calls, checkpointed_calls = result["calls"]
    assert checkpointed_calls > plain_calls, result  # each forward with a gradient ran again in the backward
    assert result["loss"] < 1e-6 and result["grad_norm"] < 1e-5, result
    assert result["weights"] < TOLERANCE, result


def test_the_start_up_probes_run_on_one_thread_and_the_threads_come_back(tiny_model_dir, monkeypatch) -> None:
    """The probes forward a few tokens: on one thread they do not wait in OpenMP's barriers for cores a rollout
    worker beside them holds (``relayrl.cores.threads.one_thread``); the trainer's own thread count is back for
    training."""
    from relayrl.trainer.backends import fsdp
    from relayrl.trainer.precision import Precision

    class Probed(Exception):
        """Raised by the last probe: the rest of the load (the world's sharding) is not this test's."""

    def last_probe(model) -> None:
        seen.append(("layout", torch.get_num_threads()))
        raise Probed

    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(fsdp, "head_plan", lambda model: seen.append(("head", torch.get_num_threads())))
    monkeypatch.setattr(fsdp, "layout_unsupported", last_probe)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        precision = Precision.resolve(TrainerConfig(), "auto", torch.device("cpu"))
        with pytest.raises(Probed):
            fsdp.load_trained_model(str(tiny_model_dir), precision, torch.device("cpu"))
        assert seen == [("head", 1), ("layout", 1)] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def file_mapped(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of ``path`` (/proc/self/maps)."""
    target = str(path.resolve())
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def test_a_float32_checkpoints_parameters_are_copied_out_of_the_mapped_file(tiny_model_dir, monkeypatch) -> None:
    """transformers keeps a float32 checkpoint's float32 tensors as views of the privately mapped safetensors file
    (the premise, checked first); the trainer's parameters are its own memory (``own_parameters``): a write is no
    copy-on-write fault, and tied weights are still one tensor."""
    from transformers import AutoModelForCausalLM

    from relayrl.trainer.backends import fsdp
    from relayrl.trainer.precision import Precision

    weights = tiny_model_dir / "model.safetensors"
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ranges = file_mapped(weights)
    assert any(lo <= p.data_ptr() < hi for p in plain.parameters() for lo, hi in ranges)

    class Probed(Exception):
        """Raised by the first probe: the model as loaded is what this test looks at."""

    def first_probe(model) -> None:
        ranges = file_mapped(weights)
        assert not any(lo <= p.data_ptr() < hi for p in model.parameters() for lo, hi in ranges)
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert tied == plain.config.tie_word_embeddings
        raise Probed

    monkeypatch.setattr(fsdp, "head_plan", first_probe)
    precision = Precision.resolve(TrainerConfig(), "auto", torch.device("cpu"))
    with pytest.raises(Probed):
        fsdp.load_trained_model(str(tiny_model_dir), precision, torch.device("cpu"))
