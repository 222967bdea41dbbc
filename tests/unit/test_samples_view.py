"""``relayrl samples`` on a run's training records (relayrl/trainer/samples.py, relayrl/ops/samples_view.py): each
prompt as the user wrote it with its answer (the controller's ``Batch.prompts``), not the chat-templated prompt,
which ``--rendered`` adds; a batch without prompt texts shows the rendered prompt and claims no answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from relayrl.config import SamplesConfig
from relayrl.data.dataset import render_prompt
from relayrl.models.tiny_chat import build_chat_tokenizer
from relayrl.trainer.samples import step_samples
from relayrl.v1 import controller_pb2

ROOT = Path(__file__).resolve().parents[2]


def batch(tokenizer, texts: dict[int, str], with_prompts: bool) -> controller_pb2.Batch:
    """Two groups of two samples whose prompts are chat-templated as training renders them."""
    samples = [
        controller_pb2.Sample(
            prompt_id=f"0:{group}", group=group, reward=float(i), finish_reason=1,
            prompt_token_ids=render_prompt(tokenizer, text, "auto", "be brief"),
            response_token_ids=tokenizer("8")["input_ids"],
        )
        for group, text in texts.items()
        for i in range(2)
    ]  # fmt: skip
    prompts = [controller_pb2.PromptText(group=g, text=t, answer=str(g + 7)) for g, t in texts.items()]
    return controller_pb2.Batch(step=1, samples=samples, prompts=prompts if with_prompts else [])


def samples_cli(run_dir: Path, *flags: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "samples", "--run", str(run_dir), *flags],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_relayrl_samples_shows_the_users_prompt_and_answer_and_the_rendered_one_on_request(tmp_path: Path) -> None:
    tokenizer = build_chat_tokenizer()
    texts = {0: "what is 1 + 0?", 1: "what is 3 + 4?"}
    records = step_samples(batch(tokenizer, texts, True), 1, tokenizer, [0.5, -0.5] * 2, SamplesConfig(prompts=2))
    assert [(r["prompt"], r["answer"]) for r in records] == [("what is 1 + 0?", "7"), ("what is 3 + 4?", "8")]
    assert all("<|im_start|>" in r["rendered_prompt"] and "be brief" in r["rendered_prompt"] for r in records)
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    shown = samples_cli(tmp_path)
    assert "prompt 0:1: 'what is 3 + 4?' (answer '8')" in shown and "<|im_start|>" not in shown
    rendered = samples_cli(tmp_path, "--rendered")
    assert f"  as the model saw it: {records[1]['rendered_prompt']!r}" in rendered


def test_a_batch_without_prompt_texts_shows_the_rendered_prompt_and_no_answer(tmp_path: Path) -> None:
    tokenizer = build_chat_tokenizer()
    records = step_samples(batch(tokenizer, {0: "hi"}, False), 1, tokenizer, [0.5, -0.5], SamplesConfig())
    assert records[0]["prompt"] == records[0]["rendered_prompt"] and "answer" not in records[0]
    (tmp_path / "samples.jsonl").write_text(json.dumps(records[0]) + "\n")
    assert "(answer" not in samples_cli(tmp_path)
