"""Helpers shared by the tests of ``relayrl train sft | dpo | rm`` (test_train_sft.py, test_train_preference.py):
the tiny ChatML Qwen2 they train, their configs, and the command run as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from cli_testing import relayrl
from safetensors.torch import load_file
from trainer_testing import ForkedCommand
from transformers import Qwen2Config, Qwen2ForCausalLM

from relayrl.models.tiny_chat import build_chat_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def tiny_chat_model(directory: Path) -> Path:
    """A tiny ChatML Qwen2 (hidden 32, 2 layers) and its tokenizer saved at ``directory``."""
    tok = build_chat_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_config(root: Path, name: str, steps: int, *, data: dict, **sections) -> Path:
    """``root/<name>.yaml``: the run ``root/runs/<name>`` of the model at ``root/model``, ``steps`` steps of 200
    tokens in rows of 100, lr 3e-3, a checkpoint each step, float32, one thread; ``sections`` added as they are."""
    config = {
        "run": {"name": name, "dir": str(root / "runs")},
        "model": {"path": str(root / "model")},
        "data": data,
        "trainer": {
            "steps": steps, "batch_tokens": 200, "pack_tokens": 100, "lr": 3e-3, "checkpoint_every": 1,
            "precision": "float32", "threads": 1,
        },
        **sections,
    }  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def command(stage: str, *argv: str) -> list[str]:
    return [sys.executable, "-m", "relayrl.cli", "train", stage, *argv]


def train(stage: str, *argv: str) -> subprocess.CompletedProcess:
    """``train STAGE ARGV`` to its end (forked: ``ForkedCommand``), exit 0."""
    proc = ForkedCommand(["train", stage, *argv], ENV)
    try:
        code = proc.wait(timeout=300)
    finally:
        proc.send_signal(signal.SIGKILL)  # when it has not ended
    done = subprocess.CompletedProcess(command(stage, *argv), code, proc.stdout_text(), proc.stderr_text())
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def refusal(stage: str, *argv: str) -> str:
    """The one line ``train STAGE ARGV`` refuses with (exit 2), before anything starts: run in this process
    (cli_testing.relayrl_run), not as an interpreter that imports torch and transformers to print it."""
    return relayrl("train", stage, *argv)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start_until(stage: str, config: Path, run_dir: Path, step: int, *extra: str) -> ForkedCommand:
    """``train STAGE CONFIG EXTRA`` started (forked: ``ForkedCommand``) and still running once its checkpoint of
    ``step`` is complete."""
    proc = ForkedCommand(["train", stage, str(config), *extra], ENV)
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / f"step_{step}" / "trainer_state.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"ended before checkpoint {step}"
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be stopped"
    return proc


def assert_same_weights(directory: Path, other: Path) -> None:
    """The two exports' model.safetensors hold the same tensors bit for bit."""
    one, two = load_file(directory / "model.safetensors"), load_file(other / "model.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name
