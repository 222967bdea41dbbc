"""Mixed precision (relayrl/trainer/precision.py): parameters and optimizer state stay float32 under bf16 compute, so
10 AdamW steps at lr 1e-6 move a layer's weights as float32 compute does, on one rank (autocast), FSDP2 on two
ranks (MixedPrecisionPolicy) and Megatron (bf16 with float32 main parameters). A bf16 parameter updated in place
would keep ~2 % of them (an update far below half a bf16 ulp rounds away). ``model.dtype`` is refused; "auto"
picks bf16 where the hardware runs it natively."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from trainer_testing import full_weights, rollout_batch, spawn_ranks

from relayrl.config import AlgorithmConfig, ConfigError, ModelConfig, TrainerConfig, parse_config
from relayrl.runtime import precision as runtime_precision
from relayrl.runtime.ports import free_port
from relayrl.runtime.procs import exit_now
from relayrl.trainer.backends import create_backend
from relayrl.trainer.optim import adamw
from relayrl.trainer.step import train_on_batch

LAYER = "model.layers.0.mlp.down_proj.weight"
STEPS = 10
ALG = AlgorithmConfig(old_logprobs="recompute")


def changed_share(backend, tcfg: TrainerConfig) -> float:
    """The share of ``LAYER``'s entries that STEPS steps of GRPO changed (its float32 value, gathered whole)."""
    before = full_weights(backend)[LAYER]
    for seed in range(STEPS):
        train_on_batch(backend, rollout_batch(backend, seed=seed), ALG, tcfg, temperature=1.0, norm_len=7)
    after = full_weights(backend)[LAYER]
    return float((after != before).float().mean())


def case(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """bf16 compute on the FSDP backend (world ranks); in a world of one also float32, Megatron at bf16, and the
    old in-place bf16 mode (bf16 parameters under AdamW) as the control."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    shares = {}
    try:
        runs = [("fsdp", "bfloat16")]
        if world == 1:
            runs += [("fsdp", "float32"), ("megatron", "bfloat16"), ("fsdp", "in-place")]
        for backend_name, precision in runs:
            tcfg = TrainerConfig(lr=1e-6, backend=backend_name, precision=precision.replace("in-place", "bfloat16"))
            backend = create_backend(ModelConfig(path=model_dir), tcfg, with_reference=False)
            stepped = [p for group in backend.optimizer.param_groups for p in group["params"]]
            assert all(p.dtype == torch.float32 for p in stepped)  # what the optimizer updates
            if precision == "in-place":  # what model.dtype: bfloat16 did
                backend.model.to(torch.bfloat16)
                backend.optimizer = adamw(backend.trainable, tcfg)
            shares[f"{backend_name}/{precision}"] = changed_share(backend, tcfg)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(shares, f)
    finally:
        if world == 1:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    exit_now(0)  # as the trainer exits: gloo's static teardown aborted a finished rank ~1 run in 10


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_compute_moves_a_layer_at_lr_1e_6_as_float32_does(tiny_model_dir, tmp_path, world) -> None:
    out = tmp_path / "shares.json"
    spawn_ranks(case, (world, free_port(), str(tiny_model_dir), str(out)), world)
    shares = json.loads(out.read_text())
    control = shares.pop("fsdp/in-place", 0.0)
    assert len(shares) == (3 if world == 1 else 1)
    assert all(share >= 0.99 for share in shares.values()), shares
    assert control < 0.5, control  # bf16 parameters updated in place: most updates round away


def test_model_dtype_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^model\.dtype: removed; .*trainer\.precision"):
        parse_config({"model": {"path": "m", "dtype": "bfloat16"}, "data": {"path": "d.jsonl"}})


@pytest.mark.parametrize(
    ("flags", "expected"),
    [({"avx512f", "amx_bf16"}, torch.bfloat16), ({"avx512_bf16"}, torch.bfloat16), ({"avx512f"}, torch.float32)],
)
def test_auto_picks_bf16_where_the_cpu_runs_it_natively(monkeypatch, flags, expected) -> None:
    monkeypatch.setattr(runtime_precision, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    dtype, why = runtime_precision.compute_dtype("auto", "cpu")
    assert dtype == expected and why.startswith("auto: CPU")
    assert runtime_precision.compute_dtype("float32", "cpu")[0] == torch.float32
    # the engine and the reference follow the compute dtype unless set
    assert runtime_precision.engine_dtype_name("auto", "auto", "cpu") == str(expected).removeprefix("torch.")
    assert runtime_precision.engine_dtype_name("float32", "auto", "cpu") == "float32"
