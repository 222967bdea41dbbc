"""Trainer rank 0's publisher against real gRPC rollout services: a worker that freezes while its update is
out is left out by a probe, not at the update call's deadline, and the others are updated without it; a
controller that is restarting delays the plan, which the result reports apart from the update's own time; every
planned worker is probed before each update, and one that died since the plan is left out before its update; a
member that fails a broadcast update with its connections open releases the others at once (a real rollout
worker served over gRPC), and the update is redone without it, also when the released update reaches its receive
only after the retry formed its group."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from relayrl.bench.weightsync import random_tensors
from relayrl.config import GenerationLimitsConfig, WeightSyncConfig
from relayrl.models.tiny import write_tiny_model
from relayrl.rollout.hf import HFEngine
from relayrl.rollout.worker import RolloutWorker
from relayrl.rpc.server import GrpcServer
from relayrl.runtime.ports import free_port
from relayrl.services.rollout_server import RolloutServicer
from relayrl.trainer import sync
from relayrl.v1 import controller_pb2, rollout_pb2, rollout_pb2_grpc
from relayrl.weightsync import WeightBroadcastGroup, weights_checksum
from relayrl.wire.sampling import GenerationLimits

SPECS = [("embed", (64, 8), torch.float32), ("bias", (8,), torch.float32)]


class Worker(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers Stats and loads every update, unless ``freezes``: then, once an update arrives, it answers
    nothing more (Stats included) until released, as a SIGSTOPped process would."""

    def __init__(self, freezes: bool) -> None:
        self.freezes, self.frozen, self.released = freezes, threading.Event(), threading.Event()
        self.updates = self.probes = 0

    def Stats(self, request, context):
        self.probes += 1
        if self.frozen.is_set():
            self.released.wait()
        return rollout_pb2.StatsResponse()

    def UpdateWeights(self, request, context):
        self.updates += 1
        if self.freezes:
            self.frozen.set()
            self.released.wait()
        return rollout_pb2.UpdateWeightsResponse(
            policy_version=request.manifest.version, checksum=request.manifest.checksum
        )


class Plan:
    def __init__(self, workers: dict[str, str]) -> None:
        self.workers = workers

    def GetWeightSyncPlan(self, request, timeout: float):
        endpoints = [controller_pb2.WorkerEndpoint(worker_id=w, address=a) for w, a in self.workers.items()]
        return controller_pb2.WeightSyncPlan(workers=endpoints)


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "failed to connect to all addresses"


class RestartingPlan(Plan):
    """Refuses connections (UNAVAILABLE) until ``down_s`` has passed since its creation, as a controller that
    is being restarted does."""

    def __init__(self, workers: dict[str, str], down_s: float) -> None:
        super().__init__(workers)
        self.up_at = time.monotonic() + down_s

    def GetWeightSyncPlan(self, request, timeout: float):
        if time.monotonic() < self.up_at:
            raise Unavailable()
        return super().GetWeightSyncPlan(request, timeout)


class FailsMidUpdate(Worker):
    """Joins the weight group, then fails its update without receiving and stops serving, its group (and so its gloo
    connections) left open: nothing on the group's wire says it failed, and the bytes for it are never taken."""

    def __init__(self) -> None:
        super().__init__(freezes=False)
        self.group: WeightBroadcastGroup | None = None
        self.server: GrpcServer | None = None

    def InitWeightSync(self, request, context):
        self.group = WeightBroadcastGroup(
            request.master_address,
            request.master_port,
            request.rank,
            request.world_size,
            request.group_name,
            timeout_s=request.timeout_s,
        )
        return rollout_pb2.InitWeightSyncResponse(group_name=request.group_name)

    def UpdateWeights(self, request, context):
        self.updates += 1
        threading.Thread(target=self.server.stop, args=(0,)).start()  # unreachable next: a probe leaves it out
        context.abort(grpc.StatusCode.INTERNAL, "failed mid-update")


class LateFirstUpdate(RolloutWorker):
    """Its first update stalls between its group check and its receive until the next InitWeightSync has run: how a
    released update interleaves with the retry on a busy machine. Received on the newer group, it would take the
    retry's bytes and leave the retry waiting out the group's timeout."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rejoined = threading.Event()
        self.joins = self.stalls = 0

    def init_weight_sync(self, request) -> None:
        super().init_weight_sync(request)
        self.joins += 1
        if self.joins == 2:
            self.rejoined.set()

    def _update_paused(self, manifest, group):
        self.stalls += 1
        if self.stalls == 1:
            assert self.rejoined.wait(30), "the retry never formed its group"
        return super()._update_paused(manifest, group)


def serve(workers: dict[str, rollout_pb2_grpc.RolloutServiceServicer]) -> dict[str, GrpcServer]:
    servers = {}
    for wid, servicer in workers.items():
        servers[wid] = GrpcServer("127.0.0.1:0")
        servers[wid].add(
            rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
            servicer,
            rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
        )
        servers[wid].start()
    return servers


def test_a_worker_frozen_during_its_update_is_left_out_by_a_probe_and_the_rest_are_updated(tmp_path) -> None:
    workers = {"live": Worker(freezes=False), "frozen": Worker(freezes=True)}
    servers = serve(workers)
    try:
        cfg = WeightSyncConfig(transport="filesystem", verify="fingerprint", timeout_s=2)  # probes of 1 s
        plan = Plan({wid: f"127.0.0.1:{server.port}" for wid, server in servers.items()})
        publisher = sync.WeightPublisher(cfg, controller=plan, weights_dir=str(tmp_path))
        arena = publisher.arena_for(SPECS)
        arena.load(random_tensors(SPECS).items())
        result = publisher.publish(1, arena)
    finally:
        for servicer in workers.values():
            servicer.released.set()
        for server in servers.values():
            server.stop(0)
    assert workers["frozen"].frozen.is_set()  # it answered the probe before the update, then froze
    assert result.synced == ["live"] and list(result.failed) == ["frozen"]
    # left out by the probe while its call was out (the call's own deadline, 4 s, would say DEADLINE_EXCEEDED)
    assert "unreachable" in result.failed["frozen"] and "during the update" in result.failed["frozen"]
    assert workers["frozen"].updates == 1  # not tried again: its address is silent for timeout_s


def test_the_wait_for_a_restarting_controller_is_reported_apart_from_the_update(tmp_path) -> None:
    servers = serve({"live": Worker(freezes=False)})
    try:
        cfg = WeightSyncConfig(transport="filesystem", verify="fingerprint", timeout_s=2)
        plan = RestartingPlan({"live": f"127.0.0.1:{servers['live'].port}"}, down_s=1.5)
        publisher = sync.WeightPublisher(cfg, controller=plan, weights_dir=str(tmp_path))
        arena = publisher.arena_for(SPECS)
        arena.load(random_tensors(SPECS).items())
        began = time.perf_counter()
        result = publisher.publish(1, arena)
        wall = time.perf_counter() - began
    finally:
        servers["live"].stop(0)
    assert result.synced == ["live"] and not result.failed
    assert result.plan_wait_seconds >= 1.4  # the outage, retried through
    assert abs(result.seconds + result.plan_wait_seconds - wall) < 0.05  # the two add up to the publish


def test_every_worker_is_probed_and_one_dead_since_the_plan_is_left_out_before_its_update(tmp_path) -> None:
    """A receiver that died after the controller last heard from it must be found before the broadcast: a gloo
    broadcast to a dead process waits for the group's timeout."""
    workers = {"a": Worker(freezes=False), "b": Worker(freezes=False)}
    servers = serve(workers)
    try:
        cfg = WeightSyncConfig(transport="filesystem", verify="fingerprint", timeout_s=2)
        addresses = {wid: f"127.0.0.1:{server.port}" for wid, server in servers.items()}
        publisher = sync.WeightPublisher(cfg, controller=Plan(addresses), weights_dir=str(tmp_path))
        arena = publisher.arena_for(SPECS)
        arena.load(random_tensors(SPECS).items())
        first = publisher.publish(1, arena)
        assert sorted(first.synced) == ["a", "b"] and [w.probes for w in workers.values()] == [1, 1]
        servers["b"].stop(0)  # dies after the plan was made
        result = publisher.publish(2, arena)
    finally:
        for server in servers.values():
            server.stop(0)
    assert result.synced == ["a"] and list(result.failed) == ["b"] and "UNAVAILABLE" in result.failed["b"]
    assert workers["a"].probes == 2 and workers["b"].updates == 1  # b: its first update only, none after it died


@pytest.mark.parametrize("live", [RolloutWorker, LateFirstUpdate], ids=["prompt", "released_update_late"])
def test_a_member_failing_a_broadcast_update_releases_the_others_at_once_and_it_is_redone_without_it(
    tmp_path, live: type[RolloutWorker]
) -> None:
    """gloo cannot abort a wait, so before the release a real worker waiting for bytes that would not come (and the
    trainer, for a member that takes none) waited out the group's timeout; and a released update that reached its
    receive after the retry joined its group took the retry's bytes (the retry then waited out the timeout)."""
    timeout_s = 30.0
    engine = HFEngine(str(write_tiny_model(tmp_path / "tiny")))
    worker = live(engine, "live", mode="pause", limits=GenerationLimits())
    settings = SimpleNamespace(
        rollout=SimpleNamespace(limits=GenerationLimitsConfig()), weight_sync=SimpleNamespace(timeout_s=timeout_s)
    )
    failing = FailsMidUpdate()
    servers = serve({"live": RolloutServicer(worker, settings), "failing": failing})
    failing.server = servers["failing"]
    try:
        cfg = WeightSyncConfig(transport="broadcast", verify="fingerprint", timeout_s=timeout_s)
        plan = Plan({wid: f"127.0.0.1:{server.port}" for wid, server in servers.items()})
        publisher = sync.WeightPublisher(cfg, controller=plan, weights_dir="")
        weights = {name: torch.randn_like(t) for name, t in engine.named_weights()}
        arena = publisher.arena_for(engine.weight_specs())
        arena.load(weights.items())
        result = publisher.publish(1, arena)
    finally:
        publisher.close()
        for server in servers.values():
            server.stop(0)
        if failing.group is not None:
            failing.group.close()
    assert result.synced == ["live"] and list(result.failed) == ["failing"], result
    assert result.seconds < timeout_s / 3  # released, not waited out (the timeout, or a probe period of 10 s)
    assert worker.version == 1 and weights_checksum(engine.named_weights()) == weights_checksum(weights.items())


class CancelledContext:
    """grpc.ServicerContext of a call cancelled before its handler ran: ``add_callback`` answers False once the RPC
    has terminated (grpc/_server.py, ``_Context.add_callback``), and ``abort`` raises."""

    def add_callback(self, callback) -> bool:
        return False

    def abort(self, code: grpc.StatusCode, details: str):
        raise RuntimeError(f"{code.name}: {details}")


def test_an_update_cancelled_before_its_handler_began_is_not_started_and_its_group_is_closed(tmp_path) -> None:
    """No release callback can run for it, so without this its receive would wait for bytes the trainer, which gave
    up on the update, never sends."""
    engine = HFEngine(str(write_tiny_model(tmp_path / "tiny")))
    worker = RolloutWorker(engine, "live", mode="pause", limits=GenerationLimits())
    settings = SimpleNamespace(
        rollout=SimpleNamespace(limits=GenerationLimitsConfig()), weight_sync=SimpleNamespace(timeout_s=30.0)
    )
    port = free_port()
    trainer_side = WeightBroadcastGroup("127.0.0.1", port, 0, 2, "g1", timeout_s=30.0)
    try:
        worker.init_weight_sync(
            rollout_pb2.InitWeightSyncRequest(
                master_address="127.0.0.1", master_port=port, rank=1, world_size=2, group_name="g1", timeout_s=30.0
            )
        )
        request = rollout_pb2.UpdateWeightsRequest(group_name="g1")
        with pytest.raises(RuntimeError, match="FAILED_PRECONDITION: group_name: this update was cancelled"):
            RolloutServicer(worker, settings).UpdateWeights(request, CancelledContext())
        assert worker.group.broken and worker.version == 0 and worker.state == "serving"
    finally:
        trainer_side.close()
        worker.group.close()
