"""`relayrl up examples/digits-lora.yaml` as a user runs it, one run for every promise: the rank-8 adapter learns
(the last 10 steps' mean reward >= the first 10's + 0.5); each step's sync sent the adapter's bytes alone, but for
the base sent once to a worker that joined after the trainer's first sync; the trainer, SIGKILLed after its first
checkpoint, is restarted with --resume and continues the curve (no step repeated or skipped, the reward does not
fall back to the start); the exported adapter loads with PEFT."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import yaml
from integration.jobs import contiguous_records, finish, running_up, supervised_roles, wait_steps, wait_until
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relayrl.config import load_config
from relayrl.models.assets import builtin_model_path
from relayrl.runtime.procs import kill_tree

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def mean_reward(records: list[dict]) -> float:
    return sum(r["reward_mean"] for r in records) / len(records)


def test_lora_demo_learns_syncs_only_the_adapter_and_resumes_after_a_kill(tmp_path):
    raw = yaml.safe_load((ROOT / "examples/digits-lora.yaml").read_text())
    raw["run"]["dir"] = str(tmp_path / "runs")
    raw["supervisor"] = {"backoff_s": 0.5}
    config = tmp_path / "digits-lora.yaml"
    config.write_text(yaml.safe_dump(raw))
    cfg = load_config(config)
    steps, every = cfg.trainer.steps, cfg.trainer.checkpoint_every
    with running_up(config) as up:
        wait_steps(cfg, every + 1, timeout_s=900)  # step every + 1 starts after the checkpoint is written
        kill_tree(supervised_roles(cfg)["trainer"]["pid"])
        wait_until(lambda: supervised_roles(cfg)["trainer"]["restarts"] == 1, what="the trainer's restart")
        code, err = finish(up, timeout_s=1200)
    assert code == 0, err
    records = contiguous_records(cfg, steps)
    trainer = supervised_roles(cfg)["trainer"]
    assert trainer["exit_codes"] == [-9], trainer
    assert f"resumed from {cfg.run_dir / 'checkpoints' / f'step_{every}'}" in Path(trainer["log"]).read_text()

    first, last = mean_reward(records[:10]), mean_reward(records[-10:])
    resumed = mean_reward(records[every : every + 5])  # the first steps after the checkpoint the run resumed from
    assert first <= 0.3, first
    assert resumed >= first + 0.1, (first, resumed)  # the adapter came back with the checkpoint
    # the adapter learns: runs that solve every prompt end near 1.0; some collapse onto a wrong answer for a few
    # prompts first and level off at 0.70-0.80 (examples/digits-lora.yaml), still far above where they began
    assert last >= first + 0.5, (first, last)

    adapter = load_file(cfg.run_dir / "final/adapter/adapter_model.safetensors")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    base = AutoModelForCausalLM.from_pretrained(builtin_model_path(cfg))
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert adapter_bytes < full_bytes / 2
    # every update sends the adapter; a worker that registered after the trainer's starting sync gets the base
    # weights once, with the first update after it joined (at most one such update a worker: none restarted)
    sizes = [r["sync_bytes"] for r in records]
    assert set(sizes) <= {adapter_bytes, adapter_bytes + full_bytes}, set(sizes)
    assert sizes.count(adapter_bytes + full_bytes) <= cfg.rollout.workers, sizes
    assert isinstance(peft.PeftModel.from_pretrained(base, cfg.run_dir / "final/adapter"), peft.PeftModel)
