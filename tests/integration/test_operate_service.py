"""The client SDK, the operator CLI and /metrics against a real controller with two real rollout workers
(gRPC servers in this process, hf engine on the tiny model; generated stubs only, no reflection)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from relayrl.client import AsyncRelayClient, RelayClient, SamplingParams
from relayrl.config import parse_config
from relayrl.rewards.builtin import prefix_match
from relayrl.runtime.ports import free_port
from relayrl.services.controller_server import serve_controller
from relayrl.services.registration import Registration
from relayrl.services.rollout_server import Heartbeat, serve_rollout
from relayrl.v1 import controller_pb2

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Service:
    address: str
    controller: object
    workers: dict  # worker id -> RolloutWorker
    heartbeats: dict  # worker id -> Heartbeat
    controller_metrics: int
    worker_metrics: int


@pytest.fixture(scope="module")
def service(tmp_path_factory, tiny_model_dir, digits_path):
    root = tmp_path_factory.mktemp("operate")
    cfg = parse_config(
        {
            "run": {"name": "operate", "dir": str(root / "runs")},
            "model": {"path": str(tiny_model_dir)},
            "data": {"path": str(digits_path)},
            "rollout": {"workers": 2, "n": 4, "max_tokens": 4},
            "controller": {"prompts_per_gen_batch": 4, "train_batch_groups": 4, "dynamic_sampling": False},
            "trainer": {"steps": 5},
        }
    )
    controller_metrics, worker_metrics = free_port(), free_port()
    server, controller = serve_controller(cfg, port=0, metrics_port=controller_metrics)
    address = f"127.0.0.1:{server.port}"
    started = [
        serve_rollout(
            cfg,
            controller=address,
            host="127.0.0.1",
            port=0,
            advertise=None,
            worker_id=f"w{i}",
            metrics_port=worker_metrics if i == 0 else None,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 60
    while len(controller.registry.snapshot()) < 2:
        assert time.monotonic() < deadline, "workers did not register"
        time.sleep(0.1)
    workers = {w.worker_id: w for _, w, _ in started}
    heartbeats = {w.worker_id: h for _, w, h in started}
    yield Service(address, controller, workers, heartbeats, controller_metrics, worker_metrics)
    for worker_server, _, heartbeat in started:
        heartbeat.stop(deregister=True)
        worker_server.stop(grace_s=0)
    server.stop(grace_s=0)
    controller.stop()


DIGITS = [{"prompt": f"{d} + 1 =", "answer": str((d + 1) % 10)} for d in range(3)]


def test_sync_client_submits_prompts_and_reads_status(service):
    with RelayClient(service.address) as client:
        results = list(client.submit(DIGITS, SamplingParams(n=2, max_tokens=4), reward_fn="prefix_match"))
        status = client.status()
    assert len(results) == 6
    assert len({c.prompt_id for c in results}) == 3
    for c in results:
        assert 1 <= len(c.token_ids) <= 4 and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.reward is not None and 0.0 <= c.reward <= 1.0
        assert c.policy_version == 0 and c.worker_id in service.workers
        assert c.finish_reason in ("stop", "length") and isinstance(c.text, str)
    assert status.run_name == "operate" and {w.worker_id for w in status.workers} == {"w0", "w1"}


def test_async_client_submits_and_reads_weights(service):
    async def scenario():
        async with AsyncRelayClient(service.address) as client:
            results = [c async for c in client.submit(["7 + 1 ="], SamplingParams(n=3, max_tokens=4))]
            return results, await client.weights_status()

    results, weights = asyncio.run(scenario())
    assert len(results) == 3 and {c.sample_index for c in results} == {0, 1, 2}
    assert all(c.reward is None for c in results)  # no reward function named
    assert {w.worker_id: w.policy_version for w in weights.workers} == {"w0": 0, "w1": 0}
    assert all(not w.error for w in weights.workers)
    assert sum(w.generated_tokens for w in weights.workers) > 0


def test_pause_is_forwarded_and_a_retrying_client_gets_through_after_resume(service):
    with RelayClient(service.address, attempts=1) as client:
        paused = client.pause("maintenance")
        assert sorted(paused.workers) == ["w0", "w1"] and not paused.worker_errors
        assert {w.stats(False).state for w in service.workers.values()} == {"paused"}
        assert client.status().state == "paused"
        with pytest.raises(grpc.RpcError) as err:
            list(client.submit(["1 + 1 ="], SamplingParams(n=2, max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "paused" in err.value.details()
        started = time.monotonic()
        with RelayClient(service.address, attempts=100, backoff_s=0.1) as patient, pytest.raises(grpc.RpcError):
            list(patient.submit(["1 + 1 ="], SamplingParams(n=2, max_tokens=2), timeout=1.0))
        assert time.monotonic() - started < 2.5  # the deadline bounds the retries

    timer = threading.Timer(1.0, lambda: RelayClient(service.address).unpause())
    timer.start()
    with RelayClient(service.address, attempts=30, backoff_s=0.1, max_backoff_s=0.3) as patient:
        results = list(patient.submit(["2 + 1 ="], SamplingParams(n=2, max_tokens=2), timeout=60))
    timer.join()
    assert len(results) == 2  # refused while paused, retried, served after Resume
    assert {w.stats(False).state for w in service.workers.values()} == {"serving"}
    assert RelayClient(service.address).status().state == "running"


def test_weight_sync_request_is_pending_until_the_trainer_reports_it(service):
    with RelayClient(service.address) as client:
        request = client.sync_weights(force=True)
        weights = client.weights_status()
        assert weights.sync_request_pending == request.sync_request_id > weights.sync_request_handled
        plan = service.controller.sync_plan()
        assert plan.sync_request_id == request.sync_request_id and plan.force
        with pytest.raises(TimeoutError):
            client.wait_for_sync(request.sync_request_id, timeout=0.5, poll_s=0.1)
        client.stub.ReportWeightSync(  # what trainer rank 0 sends once it pushed the weights
            controller_pb2.ReportWeightSyncRequest(
                policy_version=0,
                seconds=0.25,
                synced_worker_ids=["w0", "w1"],
                sync_request_id=request.sync_request_id,
                reason="operator-force",
            ),
            timeout=5,
        )
        weights = client.wait_for_sync(request.sync_request_id, timeout=5)
    assert weights.sync_request_pending == 0
    assert weights.recent_syncs[-1].reason == "operator-force" and weights.recent_syncs[-1].seconds == 0.25
    assert not service.controller.sync_plan().force


def relay(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )


def test_cli_json_outputs_parse_and_list_the_workers(service, tmp_path):
    status = relay("status", "--json", "--controller", service.address)
    assert status.returncode == 0, status.stderr
    payload = json.loads(status.stdout)
    assert {w["worker_id"] for w in payload["workers"]} == {"w0", "w1"}
    assert payload["state"] == "running" and isinstance(payload["trainer_step"], int)

    weights = relay("weights", "status", "--json", "--controller", service.address)
    assert weights.returncode == 0, weights.stderr
    workers = {w["worker_id"]: w for w in json.loads(weights.stdout)["workers"]}
    assert set(workers) == {"w0", "w1"} and all(w["policy_version"] == 0 for w in workers.values())

    human = relay("status", "--controller", service.address)
    assert human.returncode == 0 and "w0" in human.stdout and "prompt ledger" in human.stdout

    scale = relay("scale", "rollout", "3", "--json", "--controller", service.address)
    assert scale.returncode == 0 and json.loads(scale.stdout)["replicas"] == 3
    assert RelayClient(service.address).status().desired_rollout_replicas == 3

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(d) + "\n" for d in DIGITS))
    out = tmp_path / "results.jsonl"
    submit = relay(
        "submit", str(prompts), "--n", "2", "--max-tokens", "4", "--reward-fn", "prefix_match",
        "--out", str(out), "--json", "--controller", service.address,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    summary = json.loads(submit.stdout)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["completions"] == len(rows) == 6 and summary["reward_mean"] is not None
    assert all({"token_ids", "logprobs", "reward", "policy_version", "text"} <= set(r) for r in rows)

    refused = relay("drain", "nobody", "--controller", service.address)
    assert refused.returncode == 1 and "NOT_FOUND" in refused.stderr
    missing = relay("status", env={"PATH": "/usr/bin:/bin"})
    assert missing.returncode == 2 and "RELAYRL_CONTROLLER" in missing.stderr


def test_cli_submit_writes_results_in_input_order_with_ids_prompts_and_null_rewards(service, tmp_path):
    """Results come back grouped by prompt in input order (whatever order the workers finish in), each with its
    prompt id (assigned ``line-<N>`` where the file gave none) and prompt; a prompt without an answer gets
    ``reward: null`` (no reward), which stays out of reward_mean, and the named reward function scores the rest."""
    lines = [
        {"prompt": "3 + 1 =", "answer": "4", "id": "given-a"},
        {"prompt": "5 + 1 ="},  # no id, no answer
        "7 + 1 =",  # a bare string
        {"prompt": "2 + 1 =", "answer": "3"},
        {"token_ids": [5, 1, 9, 2, 11], "answer": "2", "id": "given-b"},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "results.jsonl"
    submit = relay(
        "submit", str(prompts), "--n", "3", "--max-tokens", "4", "--reward-fn", "prefix_match",
        "--out", str(out), "--json", "--controller", service.address,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ids = ["given-a", "line-2", "line-3", "line-4", "given-b"]
    assert [(r["prompt_id"], r["sample_index"]) for r in rows] == [(i, k) for i in ids for k in range(3)]
    prompt_of = dict(zip(ids, ["3 + 1 =", "5 + 1 =", "7 + 1 =", "2 + 1 =", [5, 1, 9, 2, 11]]))
    answer_of = {"given-a": "4", "line-4": "3", "given-b": "2"}
    for r in rows:
        assert r["prompt"] == prompt_of[r["prompt_id"]], r
        expected = prefix_match(r["text"], answer_of[r["prompt_id"]]) if r["prompt_id"] in answer_of else None
        assert r["reward"] == expected, r
    summary = json.loads(submit.stdout)
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    assert summary["completions"] == 15 and summary["rewarded"] == len(rewards) == 9
    assert summary["reward_mean"] == pytest.approx(sum(rewards) / 9)


def test_token_is_sent_and_never_printed(service):
    token = "cli-token-never-printed-0123"
    env = {"PATH": "/usr/bin:/bin", "RELAYRL_CONTROLLER": service.address, "RELAYRL_AUTH_TOKEN": token}
    for args in (("status",), ("status", "--json"), ("weights", "status")):
        result = relay(*args, env=env)
        assert result.returncode == 0, result.stderr
        assert token not in result.stdout + result.stderr


def test_a_dispatch_answered_in_full_renews_the_registration_at_both_ends(service):
    """The controller counts a Generate it read to the end as the worker's heartbeat, and the worker, which
    answered it, skips the beat it would have sent (a busy 1,000-worker fleet beats for nothing otherwise)."""
    before = time.monotonic()
    with RelayClient(service.address) as client:
        served = {c.worker_id for c in client.submit(DIGITS, SamplingParams(n=2, max_tokens=4))}
    assert served
    for worker_id in served:
        assert service.controller.registry.get(worker_id).last_seen >= before
        assert service.heartbeats[worker_id].registration.renewed_at >= before


def test_a_renewed_registration_sends_no_heartbeat(service):
    """Two heartbeats for new worker ids against the real controller: the one whose registration was just
    renewed (by an answered dispatch, an hour's interval) never registers; the other does at once."""
    registration = Registration()
    registration.renew()
    worker = SimpleNamespace(worker_id="renewed", engine=SimpleNamespace(name="hf"), reported_version=0)
    quiet = Heartbeat(worker, registration, service.address, "127.0.0.1:1", interval_s=3600)
    control = Heartbeat(
        SimpleNamespace(**{**vars(worker), "worker_id": "beating"}), Registration(), service.address, "127.0.0.1:2"
    )
    quiet.start()
    control.start()
    try:
        deadline = time.monotonic() + 30
        while service.controller.registry.get("beating") is None:
            assert time.monotonic() < deadline, "the control heartbeat never registered"
            time.sleep(0.05)
        quiet.stop(deregister=False)  # joined: a beat it had sent would have landed before this returns
        assert service.controller.registry.get("renewed") is None
    finally:
        control.stop(deregister=True)


def test_a_worker_up_before_its_controller_registers_once_the_controller_serves(tmp_path, tiny_model_dir, digits_path):
    """A rollout worker loads faster than its controller starts: its first beat waits for the controller to serve
    (an hour's interval: a beat that failed at once and waited for the next one would never register here)."""
    port = free_port()
    worker = SimpleNamespace(worker_id="early", engine=SimpleNamespace(name="hf"), reported_version=0)
    early = Heartbeat(worker, Registration(), f"127.0.0.1:{port}", "127.0.0.1:3", interval_s=3600)
    early.start()
    time.sleep(1.0)  # its first beat is in flight, the controller not up
    cfg = parse_config({"run": {"name": "late", "dir": str(tmp_path)}, "model": {"path": str(tiny_model_dir)},
                        "data": {"path": str(digits_path)}})  # fmt: skip
    server, controller = serve_controller(cfg, port=port)
    try:
        deadline = time.monotonic() + 30
        while controller.registry.get("early") is None:
            assert time.monotonic() < deadline, "the worker never registered"
            time.sleep(0.05)
    finally:
        early.stop(deregister=False)
        server.stop(grace_s=0)
        controller.stop()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_metrics_endpoints(service):
    RelayClient(service.address).status()
    controller = scrape(service.controller_metrics)
    status_ok = 'relayrl_rpc_requests_total{code="OK",method="Status",service="relayrl.v1.ControllerService"}'
    assert status_ok in controller
    assert 'relayrl_rpc_duration_seconds_bucket{le="0.005",method="Status"' in controller
    assert "relayrl_rpc_requests_total{" in controller and 'code="NOT_FOUND",method="DrainWorker"' in controller
    for name in ("relayrl_policy_version", "relayrl_batches_ready", 'relayrl_ledger_prompts{state="pending"}'):
        assert name in controller
    assert 'relayrl_workers{state="ready"} 2.0' in controller
    assert 'relayrl_weight_syncs_total{reason="operator-force"} 1.0' in controller
    worker = scrape(service.worker_metrics)
    assert 'relayrl_rollout_generated_tokens_total{worker="w0"}' in worker
    assert 'method="Generate",service="relayrl.v1.RolloutService"' in worker
    assert "process_cpu_seconds_total" in worker


def test_drained_worker_gets_no_new_work(service):  # last: it leaves w1 draining
    with RelayClient(service.address) as client:
        drained = client.drain("w1")
        assert drained.state == "draining"
        assert {w.worker_id: w.state for w in client.status().workers} == {"w0": "ready", "w1": "draining"}
        time.sleep(1.5)  # a heartbeat in between must not undo the drain
        results = list(client.submit([f"{d} + 1 =" for d in range(6)], SamplingParams(n=2, max_tokens=2)))
    assert len(results) == 12 and {c.worker_id for c in results} == {"w0"}
