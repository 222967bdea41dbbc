"""``relayrl reward serve``'s ScorerService over real gRPC (relayrl/services/scorer_server.py): a served reward
model scores what ``AutoModelForSequenceClassification`` scores on the same conversations rendered with its own
chat template; a judge scores alike on the hf, vLLM and SGLang engines; a teacher's log-probs are the causal LM's
own; bad requests get their precise status naming the field and the server lives on; health and reflection;
requests from several callers share model calls."""

from __future__ import annotations

import re
import sys
import threading

import grpc
import pytest
import torch
from fakes import fake_sglang, fake_vllm
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from relayrl.config import RelayConfig
from relayrl.models.tiny_chat import write_tiny_chat_model
from relayrl.rewards.served import ScorerClient, ScorerFailed
from relayrl.rpc.channels import open_channel
from relayrl.scorer.batcher import DynamicBatcher
from relayrl.scorer.models import judged_score
from relayrl.services.scorer_server import serve_scorer
from relayrl.v1 import environment_pb2, scorer_pb2, scorer_pb2_grpc
from tests.unit.scorer_testing import write_tiny_judge, write_tiny_reward_model


def chat(*turns: str) -> list[dict[str, str]]:
    """role:content turns as chat messages."""
    return [{"role": t.split(":", 1)[0], "content": t.split(":", 1)[1]} for t in turns]


CONVERSATIONS = [
    chat("user:2 + 3?", "assistant:5"),
    chat("system:Be brief.", "user:hi", "assistant:hello there, how are you"),
    chat("user:guess my number", "assistant:4"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """scorer name -> (address, its ScorerConfig): a reward model, a teacher, a judge that answers numbers and one
    that answers none, each its own server."""
    root = tmp_path_factory.mktemp("scorers")
    rm = write_tiny_reward_model(root / "rm", seed=1)
    teacher = write_tiny_chat_model(root / "teacher", seed=2, pretrain=False)
    judge = write_tiny_judge(root / "judge", seed=2)
    scorers = {
        "rm": {"model": str(rm), "max_tokens": 64, "max_items": 8, "precision": "float32", "servers": ["127.0.0.1:1"]},
        "teacher": {"kind": "teacher", "model": str(teacher), "precision": "float32", "servers": ["127.0.0.1:1"]},
        "judge": {"kind": "judge", "model": str(judge), "precision": "float32", "servers": ["127.0.0.1:1"]},
        "mute": {"kind": "judge", "model": str(teacher), "precision": "float32", "servers": ["127.0.0.1:1"]},
    }
    cfg = RelayConfig.model_validate({"model": {"path": "m"}, "data": {"path": "d"}, "scorers": scorers})
    running = {name: serve_scorer(cfg, name, host="127.0.0.1", port=0) for name in scorers}
    yield {name: (f"127.0.0.1:{server.port}", cfg.scorers[name]) for name, (server, _) in running.items()}
    for server, worker in running.values():
        server.stop(grace_s=0)
        worker.stop()


def client(served, name: str) -> ScorerClient:
    address, scorer = served[name]
    return ScorerClient(name, scorer.model_copy(update={"servers": [address], "timeout_s": 10}))


def test_served_scores_are_the_classifiers_own_on_its_own_chat_template(served) -> None:
    scores = client(served, "rm").score(CONVERSATIONS)
    path = served["rm"][1].model
    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    own = []
    for conversation in CONVERSATIONS:
        ids = tokenizer(tokenizer.apply_chat_template(conversation, tokenize=False), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            own.append(model(input_ids=ids).logits[0, 0].item())
    assert scores == pytest.approx(own, abs=1e-5)
    assert len(set(scores)) == 3 and max(map(abs, scores)) > 0.1  # scores that tell the conversations apart


def test_a_teachers_log_probs_are_the_causal_lms_own(served) -> None:
    prompt, response = [5, 9, 17, 3], [22, 8, 41]
    (served_lps,) = client(served, "teacher").token_logprobs([(prompt, response)])
    model = AutoModelForCausalLM.from_pretrained(served["teacher"][1].model)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    own = [torch.log_softmax(logits[len(prompt) - 1 + t], -1)[token].item() for t, token in enumerate(response)]
    assert served_lps == pytest.approx(own, abs=1e-5)


def test_a_judges_score_is_what_its_model_answers_the_rubric(served) -> None:
    """The served judge (generating on relayrl's hf engine) answers as the chat model's own greedy ``generate`` on
    the rubric filled with each prompt and response, the conversations of one request batched together: each
    answer's first number."""
    judge = served["judge"][1]
    tokenizer = AutoTokenizer.from_pretrained(judge.model)
    model = AutoModelForCausalLM.from_pretrained(judge.model)
    expected = []
    for conversation in CONVERSATIONS:
        turns = {m["role"]: m["content"] for m in conversation}  # one user and one assistant turn each
        question = judge.rubric.format(prompt=turns["user"], response=turns["assistant"])
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=False
        )
        out = model.generate(
            ids, max_new_tokens=judge.judge_max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        expected.append(judged_score(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)))
    assert all(isinstance(score, float) for score in expected), expected  # a number in every answer
    assert client(served, "judge").score(CONVERSATIONS) == expected


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_judge_on_the_vllm_or_sglang_engine_scores_as_on_hf(served, engine: str, monkeypatch) -> None:
    """``engine: vllm|sglang`` serves the judge through relayrl's adapter of that engine, as a rollout worker's
    ``rollout.engine`` does (the fake module stands in for the engine, as in the adapters' tests): the same rubric
    answers parse to the same scores as the hf judge's."""
    fake = {"vllm": fake_vllm, "sglang": fake_sglang}[engine]
    for module in fake.MODULES:
        monkeypatch.setitem(sys.modules, module, fake)
    judge = served["judge"][1].model_copy(update={"engine": engine})
    cfg = RelayConfig.model_validate({"model": {"path": "m"}, "data": {"path": "d"}, "scorers": {"judge": judge}})
    server, worker = serve_scorer(cfg, "judge", host="127.0.0.1", port=0)
    try:
        assert worker.model.engine.name == engine
        scores = ScorerClient("judge", judge.model_copy(update={"servers": [f"127.0.0.1:{server.port}"]}))
        assert scores.score(CONVERSATIONS) == client(served, "judge").score(CONVERSATIONS)
    finally:
        server.stop(grace_s=0)
        worker.stop()


def test_a_judge_answer_without_a_number_fails_its_request_quoting_it(served) -> None:
    """The untrained chat model as a judge answers newlines: the request is refused with the answer quoted."""
    with pytest.raises(ScorerFailed, match=re.escape("scorer mute: INTERNAL: ValueError: the judge answered '': no")):
        client(served, "mute").score(CONVERSATIONS[:1])


def call_status(stub, method: str, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        getattr(stub, method)(request, timeout=10)
    return caught.value.code(), caught.value.details()


def item(*roles_contents: tuple[str, str], **ids) -> scorer_pb2.ScoreItem:
    return scorer_pb2.ScoreItem(
        messages=[environment_pb2.ChatMessage(role=r, content=c) for r, c in roles_contents], **ids
    )


def test_bad_requests_get_their_status_naming_the_field_and_the_server_lives(served) -> None:
    stub = scorer_pb2_grpc.ScorerServiceStub(open_channel(served["rm"][0]))
    good = item(("user", "2 + 3?"), ("assistant", "5"))
    invalid, exhausted = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
    cases = [
        ([], invalid, "items"),
        ([good, item()], invalid, "items[1].messages"),
        ([item(("user", "hi"))], invalid, "items[0].messages[0].role"),
        ([item(("robot", "x"), ("assistant", "y"))], invalid, "items[0].messages[0].role"),
        ([good] * 9, exhausted, "items"),
        ([item(("user", "word " * 80), ("assistant", "5"))], exhausted, "items[0] tokens"),
        ([item(("user", "a"), ("assistant", "b"), response_token_ids=[10**6])], invalid, "items[0].response_token_ids"),
    ]
    for items, code, field in cases:
        got, details = call_status(stub, "Score", scorer_pb2.ScoreRequest(items=items))
        assert (got, details.split(":")[0]) == (code, field), details
    got, details = call_status(stub, "TokenLogprobs", scorer_pb2.TokenLogprobsRequest(items=[good]))
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "TokenLogprobs" in details
    teacher = scorer_pb2_grpc.ScorerServiceStub(open_channel(served["teacher"][0]))
    got, details = call_status(
        teacher, "TokenLogprobs", scorer_pb2.TokenLogprobsRequest(items=[item(prompt_token_ids=[1])])
    )
    assert (got, details.split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, "items[0].response_token_ids")
    with pytest.raises(ScorerFailed, match="scorer rm: RESOURCE_EXHAUSTED: items\\[0\\] tokens"):
        client(served, "rm").score([[{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "5"}]])
    assert len(stub.Score(scorer_pb2.ScoreRequest(items=[good]), timeout=10).scores) == 1  # still serving
    described = stub.Describe(scorer_pb2.DescribeRequest(), timeout=10)
    assert (described.name, described.kind) == ("rm", "classifier") and described.items_scored >= 1
    health = health_pb2_grpc.HealthStub(open_channel(served["rm"][0]))
    answer = health.Check(health_pb2.HealthCheckRequest(service="relayrl.v1.ScorerService"), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_requests_of_several_callers_share_one_model_call() -> None:
    calls: list[list[int]] = []
    batcher = DynamicBatcher(
        lambda items: calls.append(items) or [x * 2 for x in items], max_batch_size=4, max_wait_s=30
    )
    results: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda k=k: results.update({k: batcher.submit([k, k + 10])})) for k in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert results == {1: [2, 22], 2: [4, 24]}
    assert len(calls) == 1 and sorted(calls[0]) == [1, 2, 11, 12]  # full at 4 items: no wait for the 30 s
    failing = DynamicBatcher(
        lambda items: [ValueError("bad") if x < 0 else x for x in items], max_batch_size=8, max_wait_s=0
    )
    with pytest.raises(ValueError, match="bad"):
        failing.submit([1, -1])
    assert failing.submit([3]) == [3]  # one item's error fails its request alone
    batcher.stop()
    failing.stop()
