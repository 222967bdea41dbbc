"""gRPC face of a scorer (``relayrl reward serve``): a thin layer over ``relayrl.scorer.worker``."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import grpc
import torch
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from relayrl.config import RelayConfig
from relayrl.cores.threads import torch_threads
from relayrl.rpc.channels import open_channel
from relayrl.rpc.retry import SERVICES
from relayrl.rpc.server import GrpcServer, guarded
from relayrl.scorer.models import Pair, load_scoring_model
from relayrl.scorer.worker import ScorerWorker
from relayrl.services.metrics import MetricsEndpoint, gauge
from relayrl.v1 import controller_pb2, controller_pb2_grpc, scorer_pb2, scorer_pb2_grpc

log = logging.getLogger(__name__)


def pairs_of(items) -> list[Pair]:
    """The request's ScoreItems as Pairs (each message's role and content)."""
    return [
        Pair(
            [{"role": m.role, "content": m.content} for m in item.messages],
            list(item.prompt_token_ids),
            list(item.response_token_ids),
        )
        for item in items
    ]


class ScorerServicer(scorer_pb2_grpc.ScorerServiceServicer):
    def __init__(self, worker: ScorerWorker) -> None:
        self.worker = worker

    @guarded
    def Score(self, request, context):
        return scorer_pb2.ScoreResponse(scores=self.worker.score(pairs_of(request.items)))

    @guarded
    def TokenLogprobs(self, request, context):
        rows = self.worker.token_logprobs(pairs_of(request.items))
        return scorer_pb2.TokenLogprobsResponse(items=[scorer_pb2.TokenLogprobs(logprobs=r) for r in rows])

    @guarded
    def Describe(self, request, context):
        worker, stats = self.worker, self.worker.batcher.stats
        return scorer_pb2.DescribeResponse(
            name=worker.name, kind=worker.model.kind, model=worker.cfg.model, items_scored=stats.items,
            batches=stats.batches, mean_batch_size=stats.mean_batch_size, mean_latency_s=stats.mean_latency_s,
            queued=worker.batcher.queued,
        )  # fmt: skip


class ScorerCollector(Collector):
    """A scorer's batcher at scrape time: items, model calls, mean batch size, mean latency, queue."""

    def __init__(self, worker: ScorerWorker) -> None:
        self.worker = worker

    def collect(self) -> Iterator:
        stats, labels = self.worker.batcher.stats, {"scorer": self.worker.name}
        for name, text, value in (
            ("relayrl_scorer_items", "items scored", stats.items),
            ("relayrl_scorer_batches", "model calls", stats.batches),
        ):
            family = CounterMetricFamily(name, text, labels=["scorer"])
            family.add_metric([self.worker.name], value)
            yield family
        yield gauge("relayrl_scorer_mean_batch_size", "items per model call", stats.mean_batch_size, labels)
        yield gauge("relayrl_scorer_mean_latency_seconds", "a request's wait and compute", stats.mean_latency_s, labels)
        yield gauge("relayrl_scorer_queued_items", "items waiting for the model", self.worker.batcher.queued, labels)


class ControllerMembership:
    """A scorer started after its run (``relayrl scale reward``) joins the servers the controller calls
    (RegisterScorer, retried in the background until the controller answers) and leaves them when it stops. It joins
    again every ``interval_s`` (a server the controller calls already is not added twice), so a restarted controller,
    which calls only its config's servers, calls this one again within that interval, as a rollout worker's
    heartbeat registers it again."""

    def __init__(self, controller: str, name: str, address: str, interval_s: float = 2.0) -> None:
        self.name, self.address, self.interval_s = name, address, interval_s
        self._stub = controller_pb2_grpc.ControllerServiceStub(open_channel(controller))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._join, name="scorer-join", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        request = controller_pb2.RegisterScorerRequest(name=self.name, address=self.address)
        while not self._stop.is_set():
            try:
                SERVICES.call(lambda left: self._stub.RegisterScorer(request, timeout=min(left, 10)), deadline_s=600)
            except grpc.RpcError as err:
                log.error("scorer %s could not join the controller: %s: %s", self.name, err.code().name, err.details())
            self._stop.wait(self.interval_s)

    def leave(self) -> None:
        """Stop joining, then leave the servers the controller calls."""
        self._stop.set()
        self._thread.join(timeout=10)
        request = controller_pb2.RegisterScorerRequest(name=self.name, address=self.address, leaving=True)
        with contextlib.suppress(grpc.RpcError):
            self._stub.RegisterScorer(request, timeout=5)


def serve_scorer(
    cfg: RelayConfig, name: str, *, host: str, port: int, metrics_port: int | None = None
) -> tuple[GrpcServer, ScorerWorker]:
    """Load ``scorers.<name>``'s model and serve it on ``host:port`` (and /metrics on ``metrics_port``)."""
    scorer = cfg.scorers[name]
    torch.set_num_threads(torch_threads(cfg, "rollout"))
    model = load_scoring_model(scorer, name)
    worker = ScorerWorker(name, scorer, model)
    metrics = MetricsEndpoint(metrics_port)
    server = GrpcServer(
        f"{host}:{port}", interceptors=metrics.interceptors, security=cfg.security, reuse_port=False,
        max_message_mib=cfg.rollout.limits.max_message_mib,
    )  # fmt: skip
    server.add(
        scorer_pb2_grpc.add_ScorerServiceServicer_to_server,
        ScorerServicer(worker),
        scorer_pb2.DESCRIPTOR.services_by_name["ScorerService"],
    )
    server.start()
    metrics.start(ScorerCollector(worker))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # where relayrl up placed it (ops/placement.py)
    where = model.device if visible is None else f"{model.device}, CUDA_VISIBLE_DEVICES={visible}"
    log.info("scorer %s (%s, %s, on %s) serving on %s:%d", name, scorer.kind, scorer.model, where, host, server.port)
    return server, worker
