"""Bad requests against real server processes (``relayrl controller serve`` + ``relayrl rollout serve``): every
one is answered INVALID_ARGUMENT naming the field, or RESOURCE_EXHAUSTED naming the field and the limit, and
the servers keep serving correct requests afterwards."""

from __future__ import annotations

import math

import grpc
import pytest
import yaml

from relayrl.config import load_config
from relayrl.launcher import LocalJob, controller_status, wait_until
from relayrl.rollout.hf import HFEngine
from relayrl.rpc.channels import open_channel
from relayrl.runtime.ports import free_port
from relayrl.runtime.precision import engine_dtype_name
from relayrl.v1 import common_pb2, controller_pb2, controller_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from relayrl.weightsync.manifest import ManifestBuilder

pytestmark = pytest.mark.slow

CONTEXT = 64  # the tiny model's max_position_embeddings
LIMITS = {"max_prompts": 4, "max_n": 8, "max_tokens": 32, "max_message_mib": 1, "max_id_chars": 64}
GOOD = {"n": 2, "temperature": 1.0, "top_p": 1.0, "max_tokens": 3}
Prompt = controller_pb2.SubmitPromptsRequest.Prompt


@pytest.fixture(scope="module")
def servers(tiny_model_dir, digits_path, tmp_path_factory):
    """(controller stub, rollout stub) of real processes; the worker registered with the controller."""
    tmp = tmp_path_factory.mktemp("bad-input")
    raw = {
        "run": {"name": "bad-input", "dir": str(tmp / "runs")},
        "model": {"path": str(tiny_model_dir)},
        "data": {"path": str(digits_path)},
        "rollout": {"n": 2, "max_tokens": 4, "limits": LIMITS},
        "controller": {"prompts_per_gen_batch": 2, "train_batch_groups": 2},
        "trainer": {"mini_batches": 1},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    (tmp / "logs").mkdir()
    job = LocalJob(load_config(path), path, tmp / "logs")
    controller, rollout = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    job.spawn("controller", job.relay("controller", "serve", "--config", str(path), "--port", controller.split(":")[1]))
    wait_until(lambda: controller_status(controller), 120, "the controller", job, ["controller"])
    job.spawn(
        "rollout",
        job.relay(
            "rollout", "serve", "--config", str(path), "--port", rollout.split(":")[1], "--controller", controller
        ),
    )
    wait_until(lambda: controller_status(controller).workers, 120, "the worker", job, ["controller", "rollout"])
    try:
        yield (
            controller_pb2_grpc.ControllerServiceStub(open_channel(controller)),
            rollout_pb2_grpc.RolloutServiceStub(open_channel(rollout)),
        )
    finally:
        job.stop(grace_s=10)


def params(**changes) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{**GOOD, **changes})


def generate(rollout, prompts: list[list[int]], **changes) -> list[common_pb2.Completion]:
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.PromptInput(prompt_id=f"p{i}", token_ids=ids) for i, ids in enumerate(prompts)],
        params=params(**changes),
    )
    return [c for response in rollout.Generate(request, timeout=30) for c in response.completions]


def submit(controller, prompts: list, reward_fn: str = "", **changes) -> list:
    request = controller_pb2.SubmitPromptsRequest(prompts=prompts, params=params(**changes), reward_fn=reward_fn)
    return list(controller.SubmitPrompts(request, timeout=60))


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def assert_invalid(call, field: str) -> None:
    err = refused(call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(f"{field}:"), err.details()


def assert_exhausted(call, field: str, limit: int) -> None:
    err = refused(call)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert err.details().startswith(field) and f"limit {limit}" in err.details(), err.details()


# -- RolloutService.Generate: the list of issue 2 ----------------------------------------------------
@pytest.mark.parametrize(
    ("prompts", "changes", "field"),
    [
        ([[3, 4], []], {}, "prompts[1].token_ids"),
        ([[3, 10**6]], {}, "prompts[0].token_ids"),
        ([[3, -1]], {}, "prompts[0].token_ids"),
        ([[3]], {"n": -5}, "params.n"),
        ([[3] * 40], {"max_tokens": 30}, "params.max_tokens"),
        ([[3]], {"temperature": -0.5}, "params.temperature"),
        ([[3]], {"temperature": math.nan}, "params.temperature"),
        ([[3]], {"top_p": -0.5}, "params.top_p"),
        ([[3]], {"stop_token_ids": [10**6]}, "params.stop_token_ids"),
        ([], {}, "prompts"),
    ],
)
def test_generate_refuses_bad_fields_and_keeps_serving(servers, prompts, changes, field) -> None:
    _, rollout = servers
    assert_invalid(lambda: generate(rollout, prompts, **changes), field)
    completions = generate(rollout, [[3, 4, 5]])
    assert len(completions) == GOOD["n"] and all(c.token_ids for c in completions)


def test_generate_gives_omitted_fields_their_defaults(servers) -> None:
    """common.proto: n, top_p, max_tokens at 0 and temperature unset are omitted, not refused (issue #27)."""
    _, rollout = servers
    request = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.PromptInput(token_ids=[3, 4])])
    request.params.max_tokens = 2  # every other field omitted: n 1, temperature 1.0, top_p 1.0
    completions = [c for response in rollout.Generate(request, timeout=30) for c in response.completions]
    assert len(completions) == 1 and 1 <= len(completions[0].token_ids) <= 2


def test_generate_limits_are_resource_exhausted(servers) -> None:
    _, rollout = servers
    assert_exhausted(lambda: generate(rollout, [[3]], n=9), "params.n", 8)
    assert_exhausted(lambda: generate(rollout, [[3]], max_tokens=33), "params.max_tokens", 32)
    assert_exhausted(lambda: generate(rollout, [[3]] * 5), "prompts", 4)
    long_id = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.PromptInput(prompt_id="x" * 65, token_ids=[3])])
    long_id.params.CopyFrom(params())
    assert_exhausted(lambda: list(rollout.Generate(long_id, timeout=30)), "prompts[0].prompt_id length", 64)


def test_a_message_over_the_size_limit_is_resource_exhausted(servers) -> None:
    controller, rollout = servers
    huge = "x" * (1 << 20)
    for call in (
        lambda: rollout.Pause(rollout_pb2.PauseRequest(reason=huge), timeout=30),
        lambda: submit(controller, [Prompt(text=huge)]),
    ):
        err = refused(call)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.details(), err.details()
    assert len(generate(rollout, [[3, 4]])) == GOOD["n"]
    assert rollout.Stats(rollout_pb2.StatsRequest(), timeout=10).state == "serving"


def test_weight_rpcs_refuse_bad_fields_without_tearing_the_worker(servers, tiny_model_dir, tmp_path) -> None:
    _, rollout = servers
    init = {"master_address": "127.0.0.1", "master_port": 29500, "rank": 1, "world_size": 2, "group_name": "g"}
    bad_inits = [
        ({"master_address": "no host!"}, "master_address"),
        ({"master_port": 0}, "master_port"),
        ({"world_size": 1, "rank": 0}, "world_size"),
        ({"rank": 2}, "rank"),
        ({"group_name": ""}, "group_name"),
        ({"backend": "mpi"}, "backend"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"timeout_s": 1e6}, "timeout_s"),
    ]
    for changes, field in bad_inits:
        request = rollout_pb2.InitWeightSyncRequest(**{**init, **changes})
        assert_invalid(lambda request=request: rollout.InitWeightSync(request, timeout=10), field)
    bad_manifests = [
        (common_pb2.WeightManifest(transport="carrier pigeon"), "manifest"),
        (
            common_pb2.WeightManifest(
                transport="filesystem",
                buckets=[common_pb2.BucketSpec(index=0, dtype="float32", nbytes=16)],
                tensors=[common_pb2.TensorSpec(name="nope", shape=[4], dtype="float32", bucket=0, nbytes=16)],
            ),
            "manifest.tensors",
        ),
        (common_pb2.WeightManifest(tensors=[common_pb2.TensorSpec(name="x", dtype="float1024")]), "manifest"),
    ]
    for manifest, field in bad_manifests:
        request = rollout_pb2.UpdateWeightsRequest(manifest=manifest)
        assert_invalid(lambda request=request: rollout.UpdateWeights(request, timeout=10), field)
    served_dtype = engine_dtype_name("auto", "auto", "cpu")  # the server's config leaves both at auto
    specs = HFEngine(str(tiny_model_dir), dtype=served_dtype).weight_specs()
    partial = ManifestBuilder(transport="filesystem").build(specs[1:], version=7).to_proto()
    partial.path = str(tmp_path)
    err = refused(lambda: rollout.UpdateWeights(rollout_pb2.UpdateWeightsRequest(manifest=partial), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details() == f"manifest.tensors: {specs[0][0]}: missing from the manifest (version 7)", err.details()
    full = ManifestBuilder(transport="filesystem").build(specs, version=7).to_proto()
    full.path = str(tmp_path)  # publishes no version
    missing = rollout_pb2.UpdateWeightsRequest(manifest=full)
    err = refused(lambda: rollout.UpdateWeights(missing, timeout=10))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and err.details().startswith("manifest.path"), err
    stats = rollout.Stats(rollout_pb2.StatsRequest(), timeout=10)
    assert (stats.state, stats.policy_version) == ("serving", 0)
    assert len(generate(rollout, [[3, 4]])) == GOOD["n"]


# -- ControllerService -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompts", "changes", "field"),
    [
        ([Prompt()], {}, "prompts[0]"),
        ([Prompt(text="1 + 1 ="), Prompt(token_ids=[3, 10**6])], {}, "prompts[1].token_ids"),
        ([Prompt(token_ids=[3])], {"n": -1}, "params.n"),
        ([Prompt(token_ids=[3] * 40)], {"max_tokens": 30}, "params.max_tokens"),
        ([Prompt(token_ids=[3])], {"temperature": -1.0}, "params.temperature"),
        ([Prompt(prompt_id="a", token_ids=[3]), Prompt(prompt_id="a", token_ids=[4])], {}, "prompts[1].prompt_id"),
        ([], {}, "prompts"),
    ],
)
def test_submit_prompts_refuses_bad_fields_and_keeps_serving(servers, prompts, changes, field) -> None:
    controller, _ = servers
    assert_invalid(lambda: submit(controller, prompts, **changes), field)
    assert len(submit(controller, [Prompt(text="1 + 1 =", answer="2")], reward_fn="exact_match")) == GOOD["n"]


def test_submit_prompts_refuses_importing_modules_named_by_clients(servers) -> None:
    controller, _ = servers
    assert_invalid(lambda: submit(controller, [Prompt(token_ids=[3])], reward_fn="os:system"), "reward_fn")
    assert_invalid(lambda: submit(controller, [Prompt(token_ids=[3])], reward_fn="no_such_reward"), "reward_fn")


def test_submit_prompts_limits_are_resource_exhausted(servers) -> None:
    controller, _ = servers
    assert_exhausted(lambda: submit(controller, [Prompt(token_ids=[3])] * 5), "prompts", 4)
    assert_exhausted(lambda: submit(controller, [Prompt(token_ids=[3])], n=9), "params.n", 8)
    assert_exhausted(
        lambda: submit(controller, [Prompt(prompt_id="p" * 65, token_ids=[3])]), "prompts[0].prompt_id", 64
    )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"worker_id": ""}, "worker_id"),
        ({"address": ""}, "address"),
        ({"address": "no-port"}, "address"),
        ({"address": "host:0"}, "address"),
        ({"address": "host:99999"}, "address"),
        ({"address": "a b:80"}, "address"),
        ({"engine": "tgi"}, "engine"),
        ({"policy_version": -2}, "policy_version"),
    ],
)
def test_register_worker_refuses_bad_fields(servers, changes, field) -> None:
    controller, _ = servers
    request = controller_pb2.RegisterWorkerRequest(**{"worker_id": "w", "address": "h:1", "engine": "hf", **changes})
    assert_invalid(lambda: controller.RegisterWorker(request, timeout=10), field)


def test_register_worker_id_length_is_limited(servers) -> None:
    controller, _ = servers
    request = controller_pb2.RegisterWorkerRequest(worker_id="w" * 65, address="h:1")
    assert_exhausted(lambda: controller.RegisterWorker(request, timeout=10), "worker_id length", 64)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (controller_pb2.PullBatchRequest(step=0), "step"),
        (controller_pb2.PullBatchRequest(step=1, timeout_s=-1), "timeout_s"),
        (controller_pb2.PullBatchRequest(step=1, timeout_s=math.nan), "timeout_s"),
        (controller_pb2.PullBatchRequest(step=1, timeout_s=1e9), "timeout_s"),
        (controller_pb2.ReportStepRequest(step=0, batch_id="b"), "step"),
        (controller_pb2.ReportStepRequest(step=1), "batch_id"),
        (controller_pb2.ReportStepRequest(step=1, batch_id="b", policy_version=-1), "policy_version"),
        (controller_pb2.ReportStepRequest(step=1, batch_id="b", sync_seconds=math.inf), "sync_seconds"),
        (controller_pb2.DeregisterWorkerRequest(), "worker_id"),
    ],
)
def test_trainer_rpcs_refuse_bad_fields(servers, request_, field) -> None:
    controller, _ = servers
    method = {
        controller_pb2.PullBatchRequest: controller.PullBatch,
        controller_pb2.ReportStepRequest: controller.ReportStep,
        controller_pb2.DeregisterWorkerRequest: controller.DeregisterWorker,
    }[type(request_)]
    assert_invalid(lambda: method(request_, timeout=10), field)
    assert controller.Status(controller_pb2.StatusRequest(), timeout=10).workers
