"""The critic (algorithm.advantage: gae) on the FSDP backend, in worlds of one and two ranks: a warmup step trains
the critic alone, a full step trains both, the critic's update does not depend on the world size, a checkpoint
brings its weights and AdamW state back bit for bit, and the export is a loadable value model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from trainer_testing import full_weights, rollout_batch, spawn_ranks
from transformers import AutoModelForTokenClassification, AutoTokenizer

from relayrl.config import AlgorithmConfig, CriticConfig, ModelConfig, TrainerConfig
from relayrl.runtime.ports import free_port
from relayrl.runtime.procs import exit_now
from relayrl.trainer.backends import create_backend
from relayrl.trainer.step import train_on_batch

TCFG = TrainerConfig(lr=0.01, mini_batches=2, precision="float32")  # one rank and two agree to float rounding
ALG = AlgorithmConfig(advantage="gae", old_logprobs="recompute", lam=0.95)
CRITIC = CriticConfig(lr=0.01, cliprange_value=0.2)
TOLERANCE = 1e-5


def critic_weights(backend) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(backend.critic.model, options=options).items()}


def case(rank: int, world: int, port: int, model_dir: str, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    try:
        backend = create_backend(ModelConfig(path=model_dir), TCFG, with_reference=False, critic=CRITIC)
        policy0, critic0 = full_weights(backend), critic_weights(backend)
        step = dict(temperature=1.0, norm_len=7, critic_cfg=CRITIC)
        warm = train_on_batch(backend, rollout_batch(backend, seed=1), ALG, TCFG, **step, critic_only=True)
        policy1, critic1 = full_weights(backend), critic_weights(backend)
        out["warmup_policy_still"] = all(torch.equal(policy0[k], policy1[k]) for k in policy0)
        out["warmup_critic_moved"] = any(not torch.equal(critic0[k], critic1[k]) for k in critic0)
        out["warmup"] = warm
        full = train_on_batch(backend, rollout_batch(backend, seed=2), ALG, TCFG, **step)
        policy2 = full_weights(backend)
        out["policy_moved"] = any(not torch.equal(policy1[k], policy2[k]) for k in policy1)
        out["step"] = full
        saved = backend.critic.digest()
        ckpt = Path(tmp) / f"ckpt{world}"
        backend.save_checkpoint(ckpt, {"step": 2})
        train_on_batch(backend, rollout_batch(backend, seed=3), ALG, TCFG, **step)  # the live critic moves on
        out["moved_after_save"] = backend.critic.digest() != saved
        fresh = create_backend(ModelConfig(path=model_dir), TCFG, with_reference=False, critic=CRITIC)
        fresh.load_checkpoint(ckpt)
        out["resumed_bit_equal"] = fresh.critic.digest() == saved
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        fresh.export_hf(Path(tmp) / f"export{world}", tokenizer)
        batch = rollout_batch(fresh, seed=4)
        with torch.no_grad():
            live = fresh.critic.values(batch.input_ids, batch.attention_mask)
        if rank == 0:
            exported = AutoModelForTokenClassification.from_pretrained(Path(tmp) / f"export{world}" / "critic")
            with torch.no_grad():
                loaded = exported(input_ids=batch.input_ids).logits[:, :-1, 0]
            out["export_gap"] = float((loaded - live).abs().max())
            torch.save(critic_weights(fresh), Path(tmp) / f"critic{world}.pt")
        else:
            critic_weights(fresh)
        if rank == 0:
            (Path(tmp) / f"out{world}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    exit_now(0)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    tmp = tmp_path_factory.mktemp("critic")
    for world in (1, 2):
        spawn_ranks(case, (world, free_port(), str(tiny_model_dir), str(tmp)), world)
    return tmp, {w: json.loads((tmp / f"out{w}.json").read_text()) for w in (1, 2)}


@pytest.mark.parametrize("world", [1, 2])
def test_critic_warmup_then_step_resume_and_export(runs, world):
    out = runs[1][world]
    assert out["warmup_policy_still"] and out["warmup_critic_moved"] and out["policy_moved"]
    assert out["warmup"]["policy_frozen"] == 1.0 and out["step"]["policy_frozen"] == 0.0
    for key in ("value_loss", "value_clip_frac", "explained_variance", "values_mean", "returns_mean"):
        assert key in out["step"], key
    assert out["warmup"]["values_mean"] == 0.0  # the zero head: every value starts at 0
    assert out["step"]["values_mean"] != 0.0
    assert out["moved_after_save"] and out["resumed_bit_equal"]
    assert out["export_gap"] < TOLERANCE


def test_the_critics_update_does_not_depend_on_the_world_size(runs):
    tmp, _ = runs
    one, two = torch.load(tmp / "critic1.pt"), torch.load(tmp / "critic2.pt")
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, atol=TOLERANCE, rtol=0, msg=name)
