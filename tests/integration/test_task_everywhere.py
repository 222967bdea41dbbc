"""The training task is the task everywhere (issue 45, items 2 and 5), through a real controller and a real rollout
worker (gRPC servers in this process, hf engine on a tiny chat model), with a system prompt, a prompt template,
column names of the user's own, a stop string and two weighted reward functions: a held-out set that names only
its path renders each row to the token ids training does and stops as training does (greedy on both sides: the
same response), and reports each reward function's metrics beside the weighted score's; a client of the SDK
gets the system prompt and may name the config's weighted reward (``config``) or one of its functions."""

from __future__ import annotations

import json

import grpc
import pytest
from transformers import AutoTokenizer

from relayrl.client import RelayClient, SamplingParams
from relayrl.config import parse_config
from relayrl.data.readable import finish_name
from relayrl.models.tiny import write_tiny_model
from relayrl.services.controller_server import serve_controller
from relayrl.services.rollout_server import serve_rollout
from relayrl.trainer.metrics import eval_record
from relayrl.v1 import common_pb2

pytestmark = pytest.mark.slow

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}= {% endif %}"
ROWS = [{"question": f"{a} + {b}", "solution": str(a + b)} for a, b in ((1, 2), (2, 3), (3, 4), (4, 4), (2, 2))]
STOP = "==="  # the tiny model greedily repeats "=": every response stops at its third token
REWARDS = """
def correct(response, answer):
    return float(response.strip().startswith(answer))


def brevity(response):
    return 1.0 / (1 + len(response.split()))
"""
WEIGHTS = {"task_rewards:correct": 1.0, "task_rewards:brevity": 0.5}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("task")
    model = write_tiny_model(tmp / "chat-model", seed=0, chat_template=TEMPLATE, hidden_size=32, layers=2)
    rows = tmp / "sums.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp / "task_rewards.py").write_text(REWARDS)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.syspath_prepend(str(tmp))
    data = {
        "path": str(rows), "prompt_key": "question", "answer_key": "solution", "prompt_template": "{question} =",
        "system_prompt": "9 * 9 -",  # the tiny vocabulary's words: digits, operators "shuffle": False,
    }  # fmt: skip
    cfg = parse_config(
        {
            "run": {"name": "task", "dir": str(tmp / "runs")},
            "model": {"path": str(model)},
            "data": data,
            "rollout": {"workers": 1, "n": 2, "max_tokens": 8, "temperature": 0.0, "stop": [STOP]},
            "controller": {
                "prompts_per_gen_batch": 5, "train_batch_groups": 5, "dynamic_sampling": False,
                "reward": {"fns": WEIGHTS},
            },
            "trainer": {"steps": 2, "nproc": 1, "mini_batches": 1},
            "weight_sync": {"mode": "shadow"},  # no trainer here: generate without waiting for its first weights
            "eval": {"sets": {"heldout": {"path": str(rows)}}, "max_tokens": 8},
        }
    )  # fmt: skip
    server, controller = serve_controller(cfg, port=0)
    address = f"127.0.0.1:{server.port}"
    worker_server, _, heartbeat = serve_rollout(
        cfg, controller=address, host="127.0.0.1", port=0, advertise=None, worker_id="w0"
    )
    try:
        batch = controller.pull_batch(1, timeout_s=120)
        yield cfg, controller, address, batch, AutoTokenizer.from_pretrained(model)
    finally:
        heartbeat.stop(deregister=True)
        worker_server.stop(grace_s=0)
        server.stop(grace_s=0)
        controller.stop()
        monkeypatch.undo()


@pytest.fixture(scope="module")
def measured(served):
    """The held-out set's eval at version 0: (its result, its readable samples by row)."""
    _, controller, _, _, _ = served
    (heldout,) = controller.evaluator.sets
    measured = controller.evaluator.measure(heldout, 0)
    assert measured is not None
    result, samples = measured
    return result, {s["prompt_id"].rpartition("/")[2]: s["samples"][0] for s in samples}


def test_an_eval_sample_renders_and_stops_as_the_training_sample_of_its_row(served, measured) -> None:
    _, controller, _, batch, _ = served
    records = {r.prompt_id.rpartition("/")[2]: r for r in controller.evaluator.sets[0].records}
    result, eval_samples = measured
    for sample in batch.samples:
        row = sample.prompt_id.rpartition(":")[2]
        # the eval's prompt: the same system turn, template and columns, to the token
        assert records[row].token_ids == list(sample.prompt_token_ids)
        assert (records[row].text, records[row].answer) == (
            f"{ROWS[int(row)]['question']} =",
            ROWS[int(row)]["solution"],
        )
        # greedy on both sides from the same weights: the same response, ended the same way (at the stop string,
        # which the reward's text leaves out)
        text = controller.scorer.decode_all([common_pb2.Completion(token_ids=sample.response_token_ids)])[0]
        assert eval_samples[row]["response"] == text
        assert eval_samples[row]["finish_reason"] == finish_name(sample.finish_reason) == "stop"
    lengths = [len(s.response_token_ids) for s in batch.samples]
    assert result.metrics["response_len_mean"] == sum(lengths) / len(lengths) < 8
    assert result.metrics["truncated_frac"] == 0.0


def test_the_eval_reports_each_reward_function_beside_the_weighted_score(measured) -> None:
    result, _ = measured
    line = eval_record(result)  # what metrics.jsonl (and every eval sink) gets
    names = {"mean@1", "pass@1", *(f"{f}/{m}" for f in ("correct", "brevity") for m in ("mean@1", "pass@1"))}
    assert names <= set(line), sorted(line)
    # the responses are empty (cut at the stop string): not correct, as brief as can be
    assert (line["correct/mean@1"], line["brevity/mean@1"], line["brevity/pass@1"]) == (0.0, 1.0, 1.0)
    assert line["mean@1"] == pytest.approx(1.0 * line["correct/mean@1"] + 0.5 * line["brevity/mean@1"])


def test_a_client_gets_the_system_prompt_and_may_name_the_configs_rewards(served) -> None:
    _, _, address, batch, _ = served
    greedy = SamplingParams(n=1, max_tokens=8, temperature=0.0, stop=(STOP,))
    row = ROWS[0]
    prompt = {"prompt": f"{row['question']} =", "answer": row["solution"]}
    trained = next(s for s in batch.samples if s.prompt_id == "0:0")
    with RelayClient(address) as client:

        def submit(reward_fn: str = "", raw: bool = False, **prompt_fields):
            return list(client.submit([{**prompt, **prompt_fields}], greedy, reward_fn=reward_fn, raw=raw))

        # the prompt as training renders it (system turn included): the same tokens, each as likely
        (templated,) = submit()
        assert templated.token_ids == list(trained.response_token_ids)
        assert templated.logprobs == pytest.approx(list(trained.rollout_logprobs), abs=1e-5)
        (bare,) = submit(raw=True)
        assert bare.logprobs != pytest.approx(templated.logprobs, abs=1e-5)  # the comparison tells prompts apart
        # the config's weighted reward, or one of its functions by its spec; none without an answer
        assert [c.reward for c in submit("config")] == [pytest.approx(0.5)]
        assert [c.reward for c in submit("task_rewards:correct")] == [0.0]
        assert [c.reward for c in submit("task_rewards:brevity")] == [1.0]
        assert [c.reward for c in submit("config", answer="")] == [None]
        with pytest.raises(grpc.RpcError) as refused:
            submit("task_rewards:other")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reward_fn" in refused.value.details()
