"""A batched async reward function that reads the dataset row and the conversation, through a real controller
and a real rollout worker (gRPC servers in this process, hf engine on the tiny model): every trained sample's
score is the function's value for that sample, and a client naming the config's function gets the same form."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from relayrl.client import RelayClient, SamplingParams
from relayrl.config import parse_config
from relayrl.services.controller_server import serve_controller
from relayrl.services.rollout_server import serve_rollout

pytestmark = pytest.mark.slow

# score = 100 * answer + characters of the response + 0.5 when the conversation opens with the row's prompt
SOURCE = """
import asyncio

CALLS = []


async def judge(responses, rows, conversations):
    CALLS.append(len(responses))
    await asyncio.sleep(0)
    return [
        100 * int(row["answer"]) + len(response) + 0.5 * (conversation[0]["content"] == row["prompt"])
        for response, row, conversation in zip(responses, rows, conversations)
    ]
"""


def test_a_batched_async_row_and_conversation_reward_scores_every_trained_sample(
    tmp_path, monkeypatch, tiny_model_dir, digits_path
) -> None:
    (tmp_path / "row_judge.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = parse_config(
        {
            "run": {"name": "rewards", "dir": str(tmp_path / "runs")},
            "model": {"path": str(tiny_model_dir)},
            "data": {"path": str(digits_path)},
            "rollout": {"workers": 1, "n": 4, "max_tokens": 4},
            "controller": {
                "prompts_per_gen_batch": 4,
                "train_batch_groups": 4,
                "dynamic_sampling": False,
                "reward": {"fn": "row_judge:judge"},
            },
            "trainer": {"steps": 2, "nproc": 1, "mini_batches": 1},
            "weight_sync": {"mode": "shadow"},  # no trainer here: generate without waiting for its first weights
        }
    )
    server, controller = serve_controller(cfg, port=0)
    address = f"127.0.0.1:{server.port}"
    worker_server, _, heartbeat = serve_rollout(
        cfg, controller=address, host="127.0.0.1", port=0, advertise=None, worker_id="w0"
    )
    try:
        batch = controller.pull_batch(1, timeout_s=120)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        assert len(batch.samples) == 16
        for sample in batch.samples:
            row = controller.dataset.row(sample.prompt_id)
            response = tokenizer.decode(list(sample.response_token_ids), skip_special_tokens=True)
            assert sample.score == pytest.approx(100 * int(row["answer"]) + len(response) + 0.5)
        import row_judge

        assert set(row_judge.CALLS) == {4}  # once per group, with the group's 4 responses

        prompts = [{"prompt": "2 + 1 =", "answer": "3"}]
        with RelayClient(address) as client:
            results = list(client.submit(prompts, SamplingParams(n=2, max_tokens=4), reward_fn="row_judge:judge"))
        assert [c.reward for c in results] == [pytest.approx(300 + len(c.text) + 0.5) for c in results]
    finally:
        heartbeat.stop(deregister=True)
        worker_server.stop(grace_s=0)
        server.stop(grace_s=0)
        controller.stop()
