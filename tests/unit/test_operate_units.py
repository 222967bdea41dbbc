"""Operating pieces alone, with fakes: the Kubernetes StatefulSet scaler (a mocked AppsV1Api: no cluster
here), the local launcher's scaler, the trainer's on-demand weight pushes, the sync request log and the
TensorBoard/W&B mirrors."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import grpc
import torch

from relayrl.controller.weight_syncs import WeightSyncLog
from relayrl.ops import commands, k8s, render, run_record
from relayrl.ops.parser import add_operator_commands
from relayrl.ops.scaler import LocalScaler
from relayrl.trainer.loop import pull_or_stop, wait_level
from relayrl.trainer.on_demand import OnDemandSync
from relayrl.trainer.sync import SyncResult
from relayrl.trainer.trackers import StepTrackers, scalars
from relayrl.v1 import controller_pb2
from relayrl.weightsync import WeightArena, build_manifest


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_operator_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


# -- Kubernetes ------------------------------------------------------------------------------------
def mocked_apps_api(replicas: int) -> mock.MagicMock:
    api = mock.MagicMock(name="AppsV1Api")
    api.read_namespaced_stateful_set_scale.return_value = SimpleNamespace(spec=SimpleNamespace(replicas=replicas))
    return api


def test_statefulset_scale_subresource_is_patched():
    api = mocked_apps_api(2)
    assert k8s.scale_statefulset("rl", "relayrl-rollout", 5, api=api) == 2
    api.read_namespaced_stateful_set_scale.assert_called_once_with("relayrl-rollout", "rl")
    api.patch_namespaced_stateful_set_scale.assert_called_once_with("relayrl-rollout", "rl", {"spec": {"replicas": 5}})


def test_workers_removed_by_a_scale_down_are_found_by_pod_ordinal():
    ids = [
        "relayrl-rollout-0.relayrl-rollout.rl.svc:50052",
        "relayrl-rollout-1.relayrl-rollout.rl.svc:50052",
        "relayrl-rollout-12.relayrl-rollout.rl.svc:50052",
        "relayrl-rollout-2",
        "relayrl-rollout-extra-3",
        "other-5",
    ]
    assert k8s.workers_beyond(ids, "relayrl-rollout", 2) == [
        "relayrl-rollout-12.relayrl-rollout.rl.svc:50052",
        "relayrl-rollout-2",
    ]


def test_scale_command_patches_the_statefulset_without_a_controller(monkeypatch, capsys):
    monkeypatch.delenv("RELAYRL_CONTROLLER", raising=False)
    api = mocked_apps_api(4)
    monkeypatch.setattr(k8s, "apps_api", lambda: api)
    args = parse("scale", "rollout", "1", "--k8s-namespace", "rl", "--statefulset", "relayrl-rollout", "--json")
    assert commands.cmd_scale_rollout(args) == 0
    api.patch_namespaced_stateful_set_scale.assert_called_once_with("relayrl-rollout", "rl", {"spec": {"replicas": 1}})
    assert '"previous": 4' in capsys.readouterr().out


def test_the_controller_pods_environment_names_the_statefulset(monkeypatch):
    monkeypatch.setenv("RELAYRL_K8S_NAMESPACE", "relayrl-demo")  # set by deploy/k8s/base/controller.yaml
    monkeypatch.setenv("RELAYRL_ROLLOUT_STATEFULSET", "relayrl-rollout")
    args = parse("scale", "rollout", "3")
    assert (args.k8s_namespace, args.statefulset) == ("relayrl-demo", "relayrl-rollout")


def test_scale_command_drains_the_pods_it_removes_first(monkeypatch):
    api = mocked_apps_api(3)
    monkeypatch.setattr(k8s, "apps_api", lambda: api)
    client = mock.MagicMock()
    client.__enter__.return_value = client
    client.status.return_value = controller_pb2.StatusResponse(
        workers=[
            controller_pb2.WorkerStatus(worker_id=f"relayrl-rollout-{i}.relayrl-rollout.rl.svc:50052") for i in range(3)
        ]
    )
    monkeypatch.setattr(commands, "connect", lambda args: client)
    args = parse(
        "scale", "rollout", "1", "--k8s-namespace", "rl", "--statefulset", "relayrl-rollout", "--controller", "x:1"
    )
    assert commands.cmd_scale_rollout(args) == 0
    client.scale_rollout.assert_called_once_with(1)
    drained = [c.args[0] for c in client.drain.call_args_list]
    assert drained == [f"relayrl-rollout-{i}.relayrl-rollout.rl.svc:50052" for i in (1, 2)]
    api.patch_namespaced_stateful_set_scale.assert_called_once()


def test_status_watch_refuses_a_period_that_is_not_positive(capsys):
    for period in ("0", "-1"):
        assert commands.cmd_status(parse("status", "--watch", period, "--controller", "127.0.0.1:1")) == 2
        assert "--watch: must be > 0 seconds" in capsys.readouterr().err


def test_status_table_shows_the_pace_and_its_unknowns():
    known = controller_pb2.StatusResponse(
        state="running", trainer_step=12, total_steps=60, recent_reward=0.4125, samples_per_second=85.0,
        eta_seconds=3725.0, recent_steps=10, drained_workers=["rollout-1"],
    )  # fmt: skip
    rows = dict(render.pace_rows(known))
    assert rows == {
        "trainer step": "12/60 (20%)",
        "recent reward": "0.412 (last 10 steps)",
        "samples/s": "85.0 (last 10 steps)",
        "ETA": "1h 02m",
    }
    fresh = dict(render.pace_rows(controller_pb2.StatusResponse(state="running", total_steps=60)))
    assert fresh["recent reward"].startswith("-") and fresh["ETA"].startswith("unknown")
    assert [render.duration(s) for s in (42, 185, 3725)] == ["42s", "3m 05s", "1h 02m"]


def test_status_shows_the_last_steps_rollout_correction_diagnostics_live_and_of_a_gone_run(tmp_path):
    """A live run's StatusResponse.step_metrics is a table of its rollout_corr/* rows, by name, without the
    prefix; a run whose controller is gone says the last trained step's (its metrics.jsonl, eval lines and a torn
    last line skipped) on a second line, in the --json record too."""
    live = controller_pb2.StatusResponse(
        state="running", trainer_step=7, step_metrics={"rollout_corr/kl_k1": 0.0123, "rollout_corr/ess": 0.98765}
    )
    (table,) = [t for t in render.status_tables(live) if "rollout correction" in str(t.title)]
    assert table.title.startswith("rollout correction at step 7")
    assert [list(c.cells) for c in table.columns] == [["ess", "kl_k1"], ["0.9877", "0.0123"]]
    assert not any("rollout correction" in str(t.title) for t in render.status_tables(controller_pb2.StatusResponse()))
    lines = [
        {"step": 1, "reward_mean": 0.1, "rollout_corr/kl_k3": 0.5, "kl": 0.0},
        {"step": 2, "reward_mean": 0.2, "rollout_corr/kl_k3": 0.002, "rollout_corr/is_weight_max": 2.0, "kl": 0.0},
        {"eval": "heldout", "step": 2, "mean@1": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "rew')
    record = run_record.stopped_record(tmp_path, total_steps=10)
    assert record["steps"] == 2 and record["reward_last"] == 0.2
    assert record["step_metrics"] == {"rollout_corr/kl_k3": 0.002, "rollout_corr/is_weight_max": 2.0}
    headline, correction = run_record.describe(record).splitlines()
    assert "2 of 10 steps trained" in headline
    assert correction == "rollout correction at step 2 (rollout_corr/*): is_weight_max 2, kl_k3 0.002"


def test_scale_command_rejects_half_of_the_kubernetes_flags():
    assert commands.cmd_scale_rollout(parse("scale", "rollout", "2", "--statefulset", "x")) == 2


# -- the local launcher's scaler ------------------------------------------------------------------
class FakeJob:
    def __init__(self, roles: list[str]) -> None:
        self.children = {role: mock.MagicMock() for role in roles}
        self.stopped: list[str] = []

    def stop(self, roles: list[str]) -> None:
        self.stopped += roles


def fake_stub(desired: int, workers: dict[str, int]) -> mock.MagicMock:
    stub = mock.MagicMock()
    stub.Status.return_value = controller_pb2.StatusResponse(
        desired_rollout_replicas=desired,
        workers=[controller_pb2.WorkerStatus(worker_id=w, in_flight=n) for w, n in workers.items()],
    )
    return stub


def test_local_scaler_starts_missing_workers_at_the_lowest_free_index():
    job = FakeJob(["controller", "trainer", "rollout-0", "rollout-2"])
    spawned = []
    scaler = LocalScaler(job, spawned.append, fake_stub(4, {"rollout-0": 0, "rollout-2": 0}), interval_s=0)
    scaler.tick()
    assert spawned == [1, 3]


def test_local_scaler_drains_the_highest_then_stops_it_once_idle():
    job = FakeJob(["trainer", "rollout-0", "rollout-1", "rollout-2"])
    stub = fake_stub(1, {"rollout-0": 1, "rollout-1": 0, "rollout-2": 2})
    scaler = LocalScaler(job, mock.MagicMock(), stub, interval_s=0)
    scaler.tick()
    drained = [c.args[0].worker_id for c in stub.DrainWorker.call_args_list]
    assert drained == ["rollout-1", "rollout-2"] and scaler.workers() == [0]
    scaler.tick()  # rollout-1 is idle: stopped; rollout-2 still has 2 calls in flight
    assert job.stopped == ["rollout-1"] and "rollout-1" not in job.children and "rollout-2" in job.children
    stub.Status.return_value.workers[2].in_flight = 0
    scaler.tick()
    assert job.stopped == ["rollout-1", "rollout-2"] and stub.DrainWorker.call_count == 2


def recording_scale(stub: mock.MagicMock) -> None:
    """The fake controller records ScaleRollout's count in its Status, as the real one does."""
    status = stub.Status.return_value

    def scale(request, timeout):
        status.desired_rollout_replicas = request.replicas

    stub.ScaleRollout.side_effect = scale


def test_local_scaler_gives_up_the_slot_of_a_worker_an_operator_drained():
    job = FakeJob(["rollout-0", "rollout-1"])
    spawned = []

    def spawn(k: int) -> None:
        spawned.append(k)
        job.children[f"rollout-{k}"] = mock.MagicMock()

    stub = fake_stub(2, {"rollout-0": 0, "rollout-1": 1})
    recording_scale(stub)
    status = stub.Status.return_value
    status.workers[1].state = "draining"
    scaler = LocalScaler(job, spawn, stub, interval_s=0)
    scaler.tick()  # still busy: not stopped yet; its slot is given up, not refilled
    assert job.stopped == [] and spawned == [] and status.desired_rollout_replicas == 1
    status.workers[1].in_flight = 0
    scaler.tick()
    assert job.stopped == ["rollout-1"] and spawned == [] and stub.DrainWorker.call_count == 0
    del status.workers[1]  # it deregistered; the controller lists it as drained
    status.drained_workers.append("rollout-1")
    scaler.tick()
    assert spawned == [] and stub.ScaleRollout.call_count == 1
    status.desired_rollout_replicas = 2  # `relayrl scale rollout 2`: a new worker, never the drained id
    scaler.tick()
    assert spawned == [2]


def test_local_scaler_looks_at_once_when_a_worker_exits_and_keeps_a_drained_one_gone():
    """An operator drained rollout-1 and stopped it before the scaler's next look: the exit makes it look now
    (before the supervisor's restart); the controller lists the worker as drained, so it is given up."""
    job = FakeJob(["rollout-0", "rollout-1"])
    for proc in job.children.values():
        proc.poll.return_value = None
    stub = fake_stub(0, {"rollout-0": 0, "rollout-1": 0})
    recording_scale(stub)
    scaler = LocalScaler(job, mock.MagicMock(), stub, interval_s=3600)
    scaler.tick()
    assert stub.Status.call_count == 1
    scaler.tick()  # within the interval, nothing exited: no look
    assert stub.Status.call_count == 1
    job.children["rollout-1"].poll.return_value = 0
    status = stub.Status.return_value
    del status.workers[1]
    status.drained_workers.append("rollout-1")
    scaler.tick()
    assert stub.Status.call_count == 2 and job.stopped == ["rollout-1"] and "rollout-1" not in job.children
    assert status.desired_rollout_replicas == 1 and scaler.given_up == {"rollout-1"}


def test_a_drain_after_a_scale_up_starts_no_worker():
    """`scale rollout 3`, then `drain rollout-1`: the count becomes 2 and nothing starts (a fresh rollout-3 was
    started and drained a second later). Each Status is a snapshot, as over gRPC."""
    job = FakeJob(["rollout-0", "rollout-1", "rollout-2"])
    spawn = mock.MagicMock()
    state = controller_pb2.StatusResponse(
        desired_rollout_replicas=3,
        workers=[controller_pb2.WorkerStatus(worker_id=f"rollout-{k}", state="idle") for k in range(3)],
    )
    state.workers[1].state = "draining"  # `relayrl drain rollout-1`
    stub = mock.MagicMock()
    stub.Status.side_effect = lambda *_, **__: controller_pb2.StatusResponse.FromString(state.SerializeToString())
    stub.ScaleRollout.side_effect = lambda req, timeout: setattr(state, "desired_rollout_replicas", req.replicas)
    scaler = LocalScaler(job, spawn, stub, interval_s=0)
    for _ in range(3):
        scaler.tick()
    spawn.assert_not_called()
    stub.DrainWorker.assert_not_called()
    assert state.desired_rollout_replicas == 2 and job.stopped == ["rollout-1"] and scaler.workers() == [0, 2]


def test_a_resumed_run_starts_the_count_its_controller_persisted(tmp_path):
    """After `scale rollout 1` (or a drain), `up --resume` starts one worker, not the config's two then drains one."""
    import json

    from relayrl.config import load_config
    from relayrl.controller.core import ProgressState
    from relayrl.launcher import rollout_workers

    demo = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"
    cfg = load_config(demo, [f"run.dir={tmp_path}", "rollout.workers=2"])
    assert rollout_workers(cfg, resume=True) == 2  # no state yet: the config's count
    (cfg.run_dir / "controller").mkdir(parents=True)
    state = cfg.run_dir / "controller" / "state.json"
    state.write_text(json.dumps(ProgressState().__dict__))  # never scaled: 0
    assert rollout_workers(cfg, resume=True) == 2
    state.write_text(json.dumps(ProgressState(desired_rollout_replicas=1).__dict__))  # as the controller saves it
    assert rollout_workers(cfg, resume=True) == 1 and rollout_workers(cfg, resume=False) == 2


def test_local_scaler_does_nothing_until_a_count_is_set():
    job = FakeJob(["rollout-0", "rollout-1"])
    spawn = mock.MagicMock()
    stub = fake_stub(0, {"rollout-0": 0, "rollout-1": 0})
    LocalScaler(job, spawn, stub, interval_s=0).tick()
    spawn.assert_not_called()
    stub.DrainWorker.assert_not_called()


# -- on-demand weight pushes (trainer rank 0) ------------------------------------------------------
class FakePublisher:
    def __init__(self) -> None:
        self.calls: list[tuple[int, set | None]] = []
        self.closed = 0

    def arena_for(self, specs, kind="full"):
        return WeightArena(build_manifest(specs, version=0))

    def publish(self, version, weights, only=None, kind="full"):
        self.calls.append((version, only))
        return SyncResult(version, 0.01, sorted(only or {"w0", "w1"}), {}, "sum", 8)

    def close(self) -> None:
        self.closed += 1


def plan(workers: dict[str, int], request_id: int = 0, force: bool = False) -> controller_pb2.WeightSyncPlan:
    return controller_pb2.WeightSyncPlan(
        workers=[controller_pb2.WorkerEndpoint(worker_id=w, policy_version=v) for w, v in workers.items()],
        sync_request_id=request_id,
        force=force,
    )


def test_on_demand_pushes_joiners_once_and_answers_operator_requests():
    publisher, stub = FakePublisher(), mock.MagicMock()
    syncer = OnDemandSync(publisher, stub)
    stub.GetWeightSyncPlan.return_value = plan({"w0": 0}, request_id=1)
    syncer.poll_once()
    assert publisher.calls == [] and stub.ReportWeightSync.call_count == 1  # nothing published yet: a no-op answer
    assert stub.ReportWeightSync.call_args.args[0].sync_request_id == 1
    stub.GetWeightSyncPlan.return_value = plan({"w0": 0})
    assert syncer.poll_once() is None  # no request, no joiner at version 0

    gathered = []
    syncer.publish(3, [("w", (2,), torch.float32)], gathered.append)
    assert list(gathered[0]) == ["w"]  # the step's weights were gathered into the publisher's arena
    stub.GetWeightSyncPlan.return_value = plan({"w0": 2, "w1": 3, "new": 0})  # the controller lags for w0
    pushed = syncer.poll_once()
    assert publisher.calls[-1] == (3, {"new"}) and pushed.synced == ["new"]
    report = stub.ReportWeightSync.call_args.args[0]
    assert report.reason == "joiners" and list(report.synced_worker_ids) == ["new"] and report.policy_version == 3
    assert syncer.poll_once() is None  # pushed already at version 3: not again

    stub.GetWeightSyncPlan.return_value = plan({"w0": 3, "new": 3}, request_id=7, force=True)
    syncer.poll_once()
    assert publisher.closed == 1 and publisher.calls[-1] == (3, None)
    report = stub.ReportWeightSync.call_args.args[0]
    assert report.sync_request_id == 7 and report.reason == "operator-force"


def test_on_demand_backs_off_from_a_joiner_that_fails():
    publisher, stub = FakePublisher(), mock.MagicMock()
    publisher.publish = lambda version, weights, only=None, kind="full": SyncResult(
        version, 0.0, [], {"bad": "refused"}, "", 0
    )
    syncer = OnDemandSync(publisher, stub, interval_s=30.0)
    syncer._weights, syncer._version = {"w": object()}, 4
    stub.GetWeightSyncPlan.return_value = plan({"bad": 0})
    assert syncer.poll_once() is not None
    assert syncer.poll_once() is None  # waiting out its backoff


def test_sync_log_tracks_pending_requests_and_history():
    syncs = WeightSyncLog()
    assert syncs.pending() == (0, False)
    first, second = syncs.request(force=False), syncs.request(force=True)
    assert syncs.pending() == (second, True)
    syncs.record(
        controller_pb2.WeightSyncRecord(policy_version=3, reason="operator", seconds=0.5, sync_request_id=first)
    )
    assert syncs.pending() == (second, True) and syncs.handled == first
    syncs.record(controller_pb2.WeightSyncRecord(policy_version=3, reason="step", seconds=0.25))
    syncs.record(
        controller_pb2.WeightSyncRecord(policy_version=3, reason="operator", seconds=0.5, sync_request_id=second)
    )
    assert syncs.pending() == (0, False) and syncs.count == {"operator": 2, "step": 1}
    assert [r.reason for r in syncs.history()] == ["operator", "step", "operator"]
    assert all(r.unix_time > 0 for r in syncs.history())


# -- TensorBoard / W&B ----------------------------------------------------------------------------
def test_tensorboard_events_are_written_and_wandb_is_skipped_when_absent(make_config, monkeypatch, caplog):
    from relayrl.config import load_config

    cfg = load_config(make_config("tb", trainer={"tensorboard": True, "wandb": {"project": "relayrl"}}))
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # not installed
    trackers = StepTrackers.from_config(cfg)
    trackers.log({"step": 1, "reward_mean": 0.5, "policy_version": 1, "weights_checksum": "abc", "time": 1.0})
    trackers.close()
    assert list((cfg.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "wandb package is not installed" in caplog.text
    assert scalars({"step": 1, "ok": True, "x": 2, "s": "t"}) == {"x": 2.0}


def test_grpc_errors_become_exit_code_1(capsys):
    @commands.operator_command
    def refuse(_args):
        raise FakeRpcError()

    assert refuse(argparse.Namespace()) == 1
    assert "NOT_FOUND: worker_id: nope" in capsys.readouterr().err


class FakeRpcError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.NOT_FOUND

    def details(self):
        return "worker_id: nope"


def test_help_lists_every_operator_command():
    import sys

    result = subprocess.run([sys.executable, "-m", "relayrl.cli", "--help"], capture_output=True, text=True, timeout=60)
    for name in ("submit", "status", "weights", "pause", "unpause", "resume", "drain", "scale"):
        assert name in result.stdout


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "controller restarting"


def test_a_trainer_waiting_for_a_batch_says_why_then_gets_it(caplog):
    stub = mock.MagicMock()
    batch = controller_pb2.Batch(batch_id="b4")
    stub.PullBatch.side_effect = [Unavailable(), Unavailable(), batch]
    with caplog.at_level("WARNING", logger="relayrl.trainer.loop"):
        payload = pull_or_stop(stub, 4, deadline_s=60, stop=SimpleNamespace(requested=False), warn_every_s=0)
    assert controller_pb2.Batch.FromString(payload).batch_id == "b4"
    assert "no batch for step 4 yet (UNAVAILABLE: controller restarting)" in caplog.text


class NotReady(Unavailable):
    def details(self):
        return "no batch for step 4 within 2s; retry"  # the controller's answer while the batch generates


def test_a_normal_wait_for_a_batch_is_info_and_a_long_one_a_warning(caplog):
    stub = mock.MagicMock()
    batch = controller_pb2.Batch(batch_id="b4")
    stub.PullBatch.side_effect = [NotReady(), NotReady(), batch]
    with caplog.at_level("INFO", logger="relayrl.trainer.loop"):
        pull_or_stop(stub, 4, deadline_s=60, stop=SimpleNamespace(requested=False), warn_every_s=0)
    assert [r.levelname for r in caplog.records] == ["INFO", "INFO"]
    assert "no batch for step 4 yet (UNAVAILABLE: no batch for step 4 within 2s" in caplog.text
    not_ready = NotReady().details()
    assert wait_level(not_ready, 299, 600) == logging.INFO
    assert wait_level(not_ready, 300, 600) == logging.WARNING  # half the deadline gone: a stall
    assert wait_level("controller restarting", 1, 600) == logging.WARNING
