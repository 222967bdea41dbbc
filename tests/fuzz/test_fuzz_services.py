"""Property: every malformed request to ControllerService, RolloutService and ScorerService (real server
processes) is answered with a precise status before its deadline, never INTERNAL / UNKNOWN, and the servers serve
correct requests afterwards. Requests come from three sources: any message of the method's type with hostile field
values, near-valid requests with fields off by a little, and raw bytes (sent without a serializer) that may not
parse."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from relayrl.bench.cluster import local_cluster
from relayrl.rpc.channels import open_channel
from relayrl.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    environment_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    scorer_pb2,
    scorer_pb2_grpc,
)

from .strategies import FLOATS, SHORT_TEXT, TEXT, messages, raw_bytes

pytestmark = pytest.mark.slow

VOCAB = 23  # the tiny model's vocabulary
EXAMPLES = 1000
DEADLINE_S = 10.0
# Methods that may legitimately wait longer than a short deadline (a batch that is not ready yet; a weight
# group whose master never shows up): called with a short deadline, DEADLINE_EXCEEDED is an answer for them.
WAITING = {"PullBatch": 1.0, "StreamBatch": 1.0, "InitWeightSync": 2.0}
REFUSED = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, digits_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    raw = {
        "run": {"name": "fuzz", "dir": str(tmp / "runs")},
        "model": {"path": str(tiny_model_dir)},
        "data": {"path": str(digits_path)},
        "rollout": {"n": 2, "max_tokens": 4, "limits": {"max_prompts": 8, "max_n": 8, "max_tokens": 16}},
        "controller": {"prompts_per_gen_batch": 2, "train_batch_groups": 2, "generate_timeout_s": 10},
        "trainer": {"mini_batches": 1, "steps": 1000},
        "weight_sync": {"timeout_s": 1},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    with local_cluster(path, 1, tmp / "logs") as running:
        yield running


# -- near-valid requests ---------------------------------------------------------------------------------
def sampling_params() -> st.SearchStrategy:
    return st.builds(
        common_pb2.SamplingParams,
        n=st.integers(-1, 10),
        temperature=st.one_of(st.floats(-1, 3, width=32), st.just(math.nan)),
        top_p=st.one_of(st.just(1.0), st.floats(-0.25, 1.25, width=32)),
        max_tokens=st.one_of(st.integers(1, 8), st.integers(-1, 70)),
        stop_token_ids=st.lists(st.integers(-1, VOCAB + 1), max_size=3),
        seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    )


VALID_PARAMS = st.builds(
    common_pb2.SamplingParams,
    n=st.integers(1, 4),
    temperature=st.floats(0, 2, width=32),
    top_p=st.floats(0.5, 1, width=32),
    max_tokens=st.integers(1, 6),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
)
VALID_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
TOKEN_IDS = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), st.lists(st.integers(-2, VOCAB + 2), max_size=70)
)
IDS = st.one_of(st.sampled_from(["", "a", "b"]), SHORT_TEXT, TEXT)


def near_valid_controller() -> st.SearchStrategy:
    prompt = st.builds(
        controller_pb2.SubmitPromptsRequest.Prompt,
        prompt_id=IDS,
        text=st.one_of(st.sampled_from(["3 + 1 =", "", "max of 3 4 is"]), SHORT_TEXT),
        token_ids=st.one_of(st.just([]), TOKEN_IDS),
        answer=st.one_of(st.sampled_from(["4", ""]), SHORT_TEXT),
    )
    reward = st.sampled_from(["", "exact_match", "prefix_match", "nope", "os:system", "relayrl.rewards:REWARDS"])
    valid_prompt = st.builds(controller_pb2.SubmitPromptsRequest.Prompt, token_ids=VALID_IDS, answer=st.just("4"))
    return st.one_of(
        st.tuples(
            st.just("SubmitPrompts"),
            st.builds(
                controller_pb2.SubmitPromptsRequest,
                prompts=st.lists(valid_prompt, min_size=1, max_size=3),
                params=VALID_PARAMS,
            ),
        ),
        st.tuples(
            st.just("SubmitPrompts"),
            st.builds(
                controller_pb2.SubmitPromptsRequest,
                prompts=st.one_of(st.lists(prompt, max_size=3), st.lists(prompt, max_size=10)),
                params=sampling_params(),
                reward_fn=reward,
                raw=st.booleans(),
            ),
        ),
        st.tuples(
            st.just("RegisterWorker"),
            st.builds(
                controller_pb2.RegisterWorkerRequest,
                worker_id=IDS,
                address=st.one_of(st.integers(-1, 70000).map(lambda p: f"127.0.0.1:{p}"), TEXT),
                engine=st.sampled_from(["", "hf", "vllm", "tgi"]),
                policy_version=st.integers(-3, 3),
            ),
        ),
        st.tuples(
            st.just("PullBatch"),
            st.builds(controller_pb2.PullBatchRequest, step=st.integers(-1, 3), timeout_s=FLOATS),
        ),
        st.tuples(
            st.just("ReportStep"),
            st.builds(
                controller_pb2.ReportStepRequest,
                step=st.integers(-1, 3),
                batch_id=IDS,
                policy_version=st.integers(-2, 3),
                sync_seconds=FLOATS,
                metrics=st.dictionaries(TEXT, FLOATS, max_size=3),
                synced_worker_ids=st.lists(IDS, max_size=3),
            ),
        ),
    )


def near_valid_rollout() -> st.SearchStrategy:
    prompt = st.builds(rollout_pb2.PromptInput, prompt_id=IDS, token_ids=TOKEN_IDS)
    valid_prompt = st.builds(rollout_pb2.PromptInput, prompt_id=st.sampled_from(["a", "b"]), token_ids=VALID_IDS)
    return st.one_of(
        st.tuples(
            st.just("Generate"),
            st.builds(
                rollout_pb2.GenerateRequest, prompts=st.lists(valid_prompt, min_size=1, max_size=3), params=VALID_PARAMS
            ),
        ),
        st.tuples(
            st.just("Generate"),
            st.builds(
                rollout_pb2.GenerateRequest,
                prompts=st.one_of(st.lists(prompt, max_size=3), st.lists(prompt, max_size=10)),
                params=sampling_params(),
                min_policy_version=st.integers(-1, 2),
            ),
        ),
        st.tuples(
            st.just("InitWeightSync"),
            st.builds(
                rollout_pb2.InitWeightSyncRequest,
                master_address=st.sampled_from(["127.0.0.1", "localhost", "", "no host", "::1"]),
                master_port=st.integers(-1, 70000),
                rank=st.integers(-1, 3),
                world_size=st.integers(-1, 3),
                group_name=IDS,
                backend=st.sampled_from(["", "gloo", "nccl", "mpi"]),
                timeout_s=st.one_of(st.floats(-1, 0.3), st.just(math.nan)),
            ),
        ),
    )


# -- calling ---------------------------------------------------------------------------------------------
def call(channel: grpc.Channel, service, method: str, request) -> grpc.StatusCode:
    """Send ``request`` (a message, or raw bytes sent as they are) and drain the answer; its status code."""
    path = f"/{service.full_name}/{method}"
    streaming = service.methods_by_name[method].server_streaming
    serializer = None if isinstance(request, bytes) else type(request).SerializeToString
    multicallable = (channel.unary_stream if streaming else channel.unary_unary)(path, request_serializer=serializer)
    try:
        answer = multicallable(request, timeout=WAITING.get(method, DEADLINE_S))
        if streaming:
            list(answer)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def requests(service, near_valid: st.SearchStrategy) -> st.SearchStrategy:
    """(method, request): near-valid, any message of the method's type, or raw bytes."""
    names = sorted(service.methods_by_name)
    generic = st.sampled_from(names).flatmap(
        lambda name: st.tuples(st.just(name), messages(service.methods_by_name[name].input_type))
    )
    raw = st.sampled_from(names).flatmap(
        lambda name: st.tuples(st.just(name), raw_bytes(messages(service.methods_by_name[name].input_type)))
    )
    return st.one_of(near_valid, generic, raw)


def assert_answered(method: str, code: grpc.StatusCode) -> None:
    event(code.name)  # --hypothesis-show-statistics: how the answers are spread
    assert code not in REFUSED, f"{method}: {code.name}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert method in WAITING, f"{method} did not answer within {DEADLINE_S}s"


CONTROLLER = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"]
ROLLOUT = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
GOOD_PARAMS = common_pb2.SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=3)


def health(address: str) -> int:
    stub = health_pb2_grpc.HealthStub(open_channel(address))
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_controller_answers_every_malformed_request(cluster) -> None:
    channel = open_channel(cluster.controller)
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    real = {w.worker_id for w in stub.Status(controller_pb2.StatusRequest(), timeout=10).workers}

    @FUZZ
    @given(requests(CONTROLLER, near_valid_controller()))
    def fuzz(case) -> None:
        method, request = case
        code = call(channel, CONTROLLER, method, request)
        assert_answered(method, code)
        if method == "RegisterWorker" and code == grpc.StatusCode.OK and request.worker_id not in real:
            stub.DeregisterWorker(controller_pb2.DeregisterWorkerRequest(worker_id=request.worker_id), timeout=10)

    fuzz()
    assert cluster.job.children["controller"].poll() is None, "the controller exited"
    if "Resume" in CONTROLLER.methods_by_name:  # undo an operator Pause among the fuzz requests
        resumed = call(channel, CONTROLLER, "Resume", b"")
        assert resumed in (
            grpc.StatusCode.OK,
            grpc.StatusCode.FAILED_PRECONDITION,
        )  # the latter: a run rewound past its end
    for worker in stub.Status(controller_pb2.StatusRequest(), timeout=10).workers:
        if worker.worker_id not in real:
            stub.DeregisterWorker(controller_pb2.DeregisterWorkerRequest(worker_id=worker.worker_id), timeout=10)
    assert health(cluster.controller) == health_pb2.HealthCheckResponse.SERVING
    request = controller_pb2.SubmitPromptsRequest(
        prompts=[controller_pb2.SubmitPromptsRequest.Prompt(text="3 + 1 =", answer="4")],
        params=GOOD_PARAMS,
        reward_fn="exact_match",
    )
    completions = list(stub.SubmitPrompts(request, timeout=60, wait_for_ready=True))
    assert len(completions) == GOOD_PARAMS.n and all(c.HasField("reward") for c in completions)


def test_rollout_worker_answers_every_malformed_request(cluster) -> None:
    channel = open_channel(cluster.workers[0])
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)

    @FUZZ
    @given(requests(ROLLOUT, near_valid_rollout()))
    def fuzz(case) -> None:
        method, request = case
        assert_answered(method, call(channel, ROLLOUT, method, request))

    fuzz()
    assert cluster.job.children["rollout-0"].poll() is None, "the worker exited"
    stub.Resume(rollout_pb2.ResumeRequest(), timeout=10)  # an operator Pause among the fuzz requests
    assert health(cluster.workers[0]) == health_pb2.HealthCheckResponse.SERVING
    stats = stub.Stats(rollout_pb2.StatsRequest(), timeout=10)
    assert (stats.state, stats.policy_version) == ("serving", 0)
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.PromptInput(prompt_id="p", token_ids=[3, 4])], params=GOOD_PARAMS
    )
    assert sum(len(r.completions) for r in stub.Generate(request, timeout=30)) == GOOD_PARAMS.n


# -- ScorerService -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    """`relayrl reward serve` of a tiny reward model as its own process: its address and process."""
    from relayrl.runtime.ports import free_port
    from tests.unit.scorer_testing import write_tiny_reward_model

    tmp = tmp_path_factory.mktemp("fuzz-scorer")
    scorer = {"model": str(write_tiny_reward_model(tmp / "rm")), "precision": "float32", "max_items": 8}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"path": "d"}, "scorers": {"rm": scorer}}))
    port = free_port()
    argv = [sys.executable, "-m", "relayrl.cli", "reward", "serve", "--config", str(path), "--name", "rm"]
    with (tmp / "scorer.log").open("wb") as log:
        proc = subprocess.Popen([*argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "scorer.log").read_text()
            try:
                if health(address) == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                time.sleep(0.3)
        yield address, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def near_valid_scorer() -> st.SearchStrategy:
    message = st.builds(
        environment_pb2.ChatMessage,
        role=st.sampled_from(["user", "assistant", "system", "tool", "", "robot"]),
        content=SHORT_TEXT,
    )
    item = st.builds(
        scorer_pb2.ScoreItem,
        messages=st.lists(message, max_size=3),
        prompt_token_ids=st.lists(st.integers(-3, 500), max_size=4),
        response_token_ids=st.lists(st.integers(-3, 500), max_size=4),
    )
    return st.one_of(
        st.tuples(st.just("Score"), st.builds(scorer_pb2.ScoreRequest, items=st.lists(item, max_size=10))),
        st.tuples(
            st.just("TokenLogprobs"), st.builds(scorer_pb2.TokenLogprobsRequest, items=st.lists(item, max_size=3))
        ),
    )


SCORER = scorer_pb2.DESCRIPTOR.services_by_name["ScorerService"]


def test_scorer_answers_every_malformed_request(scorer) -> None:
    address, proc = scorer
    channel = open_channel(address)

    @FUZZ
    @given(requests(SCORER, near_valid_scorer()))
    def fuzz(case) -> None:
        method, request = case
        assert_answered(method, call(channel, SCORER, method, request))

    fuzz()
    assert proc.poll() is None, "the scorer exited"
    turns = [("user", "2 + 3?"), ("assistant", "5")]
    good = scorer_pb2.ScoreItem(messages=[environment_pb2.ChatMessage(role=r, content=c) for r, c in turns])
    answer = scorer_pb2_grpc.ScorerServiceStub(channel).Score(scorer_pb2.ScoreRequest(items=[good]), timeout=30)
    assert len(answer.scores) == 1
