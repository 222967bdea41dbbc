"""``relayrl eval --checkpoint runs/NAME/checkpoints/step_N`` (relayrl/ops/evaluate.py hf_weights): a trainer
checkpoint becomes a Hugging Face directory of its model's weights, read without its optimizer state."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from relayrl.config import load_config
from relayrl.ops.evaluate import checkpoint_kind, hf_weights

ROOT = Path(__file__).resolve().parents[2]


def test_a_trainer_checkpoint_gives_its_model_weights_and_leaves_the_optimizer_state_on_disk(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.25)  # trained weights: not model.path's
    moments = {name: torch.full_like(p, 7.0) for name, p in model.named_parameters()}
    checkpoint = tmp_path / "checkpoints" / "step_3"
    dcp.save({"model": model.state_dict(), "optim": {"exp_avg": moments}}, checkpoint_id=str(checkpoint), no_dist=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 3, "policy_version": 3}))
    cfg = load_config(ROOT / "examples" / "digits.yaml", [f"model.path={tiny_model_dir}"])
    workdir = tmp_path / "work"
    workdir.mkdir()
    out, version = hf_weights(cfg, checkpoint, workdir)
    assert version == 3
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in model.state_dict().items())
    assert sorted(p.name for p in workdir.iterdir()) == ["model"]  # no converted copy of the whole checkpoint


def test_a_hugging_face_trainer_checkpoint_is_read_as_the_model_directory_it_is(tmp_path: Path) -> None:
    # transformers' Trainer (TRL's GRPOTrainer) writes its own trainer_state.json beside config.json and the weights
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": []}))
    assert checkpoint_kind(checkpoint) == "hf"
    (checkpoint / ".metadata").write_bytes(b"")  # a DCP checkpoint of relayrl's trainer has both
    assert checkpoint_kind(checkpoint) == "trainer"
