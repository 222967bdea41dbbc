"""PPO with a critic under ``relayrl up``: the trainer rank SIGKILLed mid-run is restarted with ``--resume`` and
comes back with the critic's weights and AdamW state bit-equal to what its checkpoint holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from relayrl.config import load_config
from relayrl.runtime.procs import kill_tree
from relayrl.trainer.backends.critic import state_digest

from .jobs import contiguous_records, finish, running_up, supervised_roles, wait_steps, wait_until

pytestmark = pytest.mark.slow


def saved_critic_digest(checkpoint: Path, scratch: Path) -> str:
    """``state_digest`` of the critic's weights and optimizer state as the checkpoint's files hold them, read
    without a process group or a model (torch's DCP-to-torch.save converter)."""
    dcp_to_torch_save(checkpoint, scratch)
    state = torch.load(scratch, weights_only=False)
    return state_digest({key: state[key] for key in ("critic", "critic_optim")})


@pytest.mark.timeout(1200)
def test_a_killed_trainer_resumes_the_critic_bit_equal(make_config, tmp_path):
    steps = 8
    config = make_config(
        "critic", algorithm={"advantage": "gae", "lam": 0.95},
        critic={"lr": 0.003, "warmup_steps": 1},
        trainer={"steps": steps, "checkpoint_every": 2}, supervisor={"backoff_s": 0.2},
        controller={"dynamic_sampling": False},
    )  # fmt: skip
    cfg = load_config(config)
    with running_up(config) as up:
        wait_steps(cfg, 3, timeout_s=600)
        kill_tree(supervised_roles(cfg)["trainer"]["pid"])
        log = lambda: Path(supervised_roles(cfg)["trainer"]["log"]).read_text()  # noqa: E731
        wait_until(lambda: "critic state resumed" in log(), timeout_s=300, what="the trainer's resume")
        code, err = finish(up)
    assert code == 0, err
    text = log()
    checkpoint = Path(re.findall(r"resumed from (\S+) at step", text)[-1])
    resumed = re.findall(r"critic state resumed: sha256 ([0-9a-f]{64})", text)[-1]
    assert resumed == saved_critic_digest(checkpoint, tmp_path / "saved.pt")
    records = contiguous_records(cfg, steps)  # no step repeated or skipped
    assert records[0]["policy_frozen"] == 1.0 and records[-1]["policy_frozen"] == 0.0
    assert all("explained_variance" in r and "value_loss" in r for r in records)
    assert (cfg.run_dir / "final" / "critic" / "config.json").exists()
