"""gRPC face of a rollout worker (``relayrl rollout serve``): a thin layer over ``relayrl.rollout.worker``."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from typing import Any

import grpc
import torch

from relayrl.config import RelayConfig
from relayrl.cores.threads import torch_threads
from relayrl.errors import FailedPrecondition
from relayrl.rollout.worker import RolloutWorker
from relayrl.rpc.channels import configure_client, open_channel
from relayrl.rpc.server import GrpcServer, guarded
from relayrl.rpc.validate import check_init_weight_sync, check_length
from relayrl.runtime.precision import engine_dtype_name
from relayrl.services.metrics import MetricsEndpoint, RolloutCollector
from relayrl.services.registration import Registration
from relayrl.v1 import controller_pb2, controller_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from relayrl.wire.sampling import GenerationLimits

log = logging.getLogger(__name__)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, worker: RolloutWorker, cfg: RelayConfig, registration: Registration | None = None) -> None:
        self.worker = worker
        self.registration = registration or Registration()  # what the heartbeat (if any) reads
        self.limits = cfg.rollout.limits
        self.sync_timeout_s = cfg.weight_sync.timeout_s

    @guarded
    def Generate(self, request, context):
        for i, prompt in enumerate(request.prompts):
            check_length(f"prompts[{i}].prompt_id", prompt.prompt_id, self.limits.max_id_chars)
        yield from self.worker.generate(request, context.is_active)
        if request.renews_registration:  # answered in full (a cancelled stream never gets here)
            self.registration.renew()

    @guarded
    def InitWeightSync(self, request, context):
        check_init_weight_sync(request, self.limits, self.sync_timeout_s)
        if not request.timeout_s:
            request.timeout_s = self.sync_timeout_s  # 0: this worker's weight_sync.timeout_s
        if request.backend == "nccl" and not torch.cuda.is_available():
            raise FailedPrecondition("backend: nccl needs a CUDA device on this worker")
        self.worker.init_weight_sync(request)
        return rollout_pb2.InitWeightSyncResponse(group_name=request.group_name)

    @guarded
    def UpdateWeights(self, request, context):
        check_length("group_name", request.group_name, self.limits.max_id_chars)
        answered = threading.Event()
        # a cancelled update (the trainer gave up on it) ends the receive: its group is closed
        if not context.add_callback(lambda: answered.is_set() or self.worker.release_update(request.group_name)):
            self.worker.release_update(request.group_name)  # cancelled before this handler began: never start it
            raise FailedPrecondition("group_name: this update was cancelled before it began")
        try:
            return self.worker.update_weights(request)
        finally:
            answered.set()

    @guarded
    def Pause(self, request, context):
        check_length("reason", request.reason, self.limits.max_text_chars)
        self.worker.pause()
        return rollout_pb2.PauseResponse()

    @guarded
    def Resume(self, request, context):
        self.worker.resume()
        return rollout_pb2.ResumeResponse()

    @guarded
    def Stats(self, request, context):
        return self.worker.stats(request.with_checksum)


class Heartbeat:
    """Registers the worker with the controller every ``interval_s``, or as often as the controller's last answer
    asked (``heartbeat_interval_s``: a large fleet beats less often); also after a controller restart. A beat is
    skipped while an answered dispatch renewed the registration within the interval: a busy fleet's beats would
    cost the controller CPU for nothing. Until its first answer a beat waits for the channel to connect
    (``wait_for_ready``, gRPC's reconnect backoff: relayrl.rpc.channels), so a worker that is up before the controller
    it starts with registers as soon as the controller serves, not a beat later."""

    def __init__(
        self, worker: RolloutWorker, registration: Registration, controller: str, address: str, interval_s: float = 1.0
    ) -> None:
        self.worker, self.registration, self.address, self.interval_s = worker, registration, address, interval_s
        self.next_beat_s = interval_s
        self._stub = controller_pb2_grpc.ControllerServiceStub(open_channel(controller))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._warned = False
        self._answered = False

    def start(self) -> None:
        self._thread.start()

    def beat(self) -> None:
        request = controller_pb2.RegisterWorkerRequest(
            worker_id=self.worker.worker_id,
            address=self.address,
            engine=self.worker.engine.name,
            policy_version=self.worker.reported_version,
        )
        response = self._stub.RegisterWorker(request, timeout=5, wait_for_ready=not self._answered)
        self._answered = True
        self.next_beat_s = response.heartbeat_interval_s or self.interval_s

    def _loop(self) -> None:
        while not self._stop.is_set():
            if (renewed_for := self.registration.renewed_for(self.next_beat_s)) > 0:
                self._stop.wait(renewed_for)
                continue
            try:
                self.beat()
                self._warned = False
            except grpc.RpcError as err:
                if not self._warned:
                    log.warning("controller unreachable (%s); retrying", err.code().name)
                    self._warned = True
            self._stop.wait(self.next_beat_s)

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=10)  # a beat in flight must not re-register after the deregistration
        if deregister:
            with contextlib.suppress(grpc.RpcError):
                self._stub.DeregisterWorker(
                    controller_pb2.DeregisterWorkerRequest(worker_id=self.worker.worker_id), timeout=5
                )


def hf_engine_options(cfg: RelayConfig, threads: int) -> dict[str, Any]:
    """A rollout worker's options of the hf engine alone (decode runner, intra-op ``threads``, in-flight updates,
    prefix cache, attention); none for vLLM and SGLang, which compute in their own processes."""
    if cfg.rollout.engine != "hf":
        return {}
    return {
        "decode": cfg.rollout.hf_decode,
        "threads": threads,
        "partial": cfg.rollout.partial,
        "prefix_cache_tokens": cfg.rollout.prefix_cache_tokens,
        "attn_implementation": cfg.model.attn_implementation,
    }


def serve_rollout(
    cfg: RelayConfig,
    *,
    controller: str | None,
    host: str,
    port: int,
    advertise: str | None,
    worker_id: str | None,
    metrics_port: int | None = None,
) -> tuple[GrpcServer, RolloutWorker, Heartbeat | None]:
    """Load the engine, start the gRPC server, /metrics (when ``metrics_port``) and (when a controller is
    given) the heartbeat."""
    from relayrl.rollout.engine import create_engine, worker_seed

    threads = torch_threads(cfg, "rollout")
    # the hf engine decodes on its scheduler thread with `threads`; every other thread of this process (the model
    # load here, weight loads and checksums on gRPC threads) on one: a second OpenMP team halves decode speed
    # (relayrl/rollout/intra_op.py). vLLM and SGLang compute in their own processes.
    torch.set_num_threads(1)
    engine = create_engine(
        cfg.rollout.engine,
        model_path=cfg.model.path,
        # the trainer's weight sync sends this dtype (rollout.weight_dtype; "auto" resolved on this machine)
        dtype=engine_dtype_name(
            cfg.rollout.weight_dtype, cfg.trainer.precision, "cuda" if torch.cuda.is_available() else "cpu"
        ),
        max_batch_size=cfg.rollout.max_batch_size,
        # each worker its own random stream: its id (relayrl up names them), else where it serves from
        seed=worker_seed(cfg.run.seed, worker_id or advertise or f"{socket.gethostname()}:{port}:{os.getpid()}"),
        **hf_engine_options(cfg, threads),
        routing_replay=cfg.algorithm.routing_replay,
        **cfg.rollout.engine_options,
    )
    limits = GenerationLimits(
        max_prompts=cfg.rollout.limits.max_prompts,
        max_n=cfg.rollout.limits.max_n,
        max_tokens=cfg.rollout.limits.max_tokens,
        max_message_bytes=cfg.rollout.limits.max_message_mib << 20,
    )
    configure_client(cfg.security)  # the heartbeat calls the controller
    metrics = MetricsEndpoint(metrics_port)
    server = GrpcServer(
        f"{host}:{port}",
        max_message_mib=cfg.rollout.limits.max_message_mib,
        interceptors=metrics.interceptors,
        security=cfg.security,
    )
    address = advertise or f"{'127.0.0.1' if host in ('0.0.0.0', '[::]') else host}:{server.port}"
    worker = RolloutWorker(
        engine, worker_id or address, mode=cfg.weight_sync.mode, limits=limits, partial=cfg.rollout.partial
    )
    registration = Registration()
    server.add(
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
        RolloutServicer(worker, cfg, registration),
        rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
    )
    server.start()
    metrics.start(RolloutCollector(worker))
    heartbeat = None
    if controller:
        heartbeat = Heartbeat(worker, registration, controller, address)
        heartbeat.start()
    log.info("rollout worker %s (%s) serving on %s", worker.worker_id, engine.name, address)
    return server, worker, heartbeat
