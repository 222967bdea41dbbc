"""Prometheus metrics of a relayrl server: RPCs by method and status code, plus the role's own state.

Each server gets its own ``CollectorRegistry`` (no global state, so tests may run several servers in
one process) served over HTTP at ``/metrics`` on ``--metrics-port``. RPC counts and latencies come
from a ``grpc.ServerInterceptor``; the controller's and the worker's state are read at scrape time by
custom collectors, so serving metrics costs nothing between scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from relayrl.config import ConfigError

METRICS_HOST = "0.0.0.0"  # the /metrics endpoint listens on every address
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0)


def new_registry() -> CollectorRegistry:
    """A registry with the standard process, platform and GC collectors."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Counts every RPC by service, method and final status code, and times it (streams: until the last message)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "relayrl_rpc_requests", "RPCs handled", ["service", "method", "code"], registry=registry
        )
        self.seconds = Histogram(
            "relayrl_rpc_duration_seconds",
            "RPC handling time, streams until their last message",
            ["service", "method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:  # relayrl has no client-streaming RPCs
            return handler
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        record = self._recorder(service, method)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _timed_stream(handler.unary_stream, record),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            _timed_unary(handler.unary_unary, record),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _recorder(self, service: str, method: str) -> Callable[[grpc.ServicerContext, float, bool], None]:
        def record(context: grpc.ServicerContext, started: float, raised: bool) -> None:
            code = context.code() or (grpc.StatusCode.UNKNOWN if raised else grpc.StatusCode.OK)
            self.requests.labels(service, method, code.name).inc()
            self.seconds.labels(service, method).observe(time.perf_counter() - started)

        return record


def _timed_unary(behavior, record):
    def wrapper(request, context):
        started, raised = time.perf_counter(), True
        try:
            response = behavior(request, context)
            raised = False
            return response
        finally:
            record(context, started, raised)

    return wrapper


def _timed_stream(behavior, record):
    def wrapper(request, context):
        started, raised = time.perf_counter(), True
        try:
            yield from behavior(request, context)
            raised = False
        except GeneratorExit:  # the client went away
            context.set_code(grpc.StatusCode.CANCELLED)
            raise
        finally:
            record(context, started, raised)

    return wrapper


def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), value)
    return family


class ControllerCollector(Collector):
    """The controller's state at scrape time: versions, queue depths, ledger, workers, token rate, syncs."""

    def __init__(self, controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator:
        ctl = self.controller
        status = ctl.status()
        yield gauge(
            "relayrl_policy_version", "policy version on the workers after the last step", status.policy_version
        )
        yield gauge("relayrl_trainer_step", "last trainer step reported", status.trainer_step)
        yield gauge("relayrl_dataset_cursor", "prompts drawn from the dataset", status.dataset_cursor)
        yield gauge("relayrl_batches_ready", "batches produced, not yet reported trained", ctl.batches_ready)
        yield gauge(
            "relayrl_desired_rollout_replicas", "ScaleRollout target (0: unset)", status.desired_rollout_replicas
        )
        state = GaugeMetricFamily("relayrl_run_state", "1 for the run's current state", labels=["state"])
        for name in ("running", "paused", "failed", "finished"):
            state.add_metric([name], float(status.state == name))
        yield state
        ledger = GaugeMetricFamily("relayrl_ledger_prompts", "prompts in the ledger by state", labels=["state"])
        for name in ("trained", "filtered", "failed", "pending"):
            ledger.add_metric([name], getattr(status.ledger, name))
        yield ledger
        yield gauge(
            "relayrl_ledger_torn_tails", "torn last ledger lines cut at a controller start", status.ledger.torn_tails
        )
        by_state = GaugeMetricFamily("relayrl_workers", "registered rollout workers by state", labels=["state"])
        for name in sorted({w.state for w in status.workers} | {"ready", "draining"}):
            by_state.add_metric([name], sum(w.state == name for w in status.workers))
        yield by_state
        in_flight = GaugeMetricFamily("relayrl_worker_in_flight", "Generate calls in flight", labels=["worker"])
        version = GaugeMetricFamily("relayrl_worker_policy_version", "policy version per worker", labels=["worker"])
        rate = GaugeMetricFamily("relayrl_worker_tokens_per_second", "generated tokens/s", labels=["worker"])
        for w in status.workers:
            in_flight.add_metric([w.worker_id], w.in_flight)
            version.add_metric([w.worker_id], w.policy_version)
            rate.add_metric([w.worker_id], w.tokens_per_second)
        yield from (in_flight, version, rate)
        yield gauge(
            "relayrl_rollout_tokens_per_second",
            "generated tokens/s, all workers",
            sum(w.tokens_per_second for w in status.workers),
        )
        syncs = CounterMetricFamily("relayrl_weight_syncs", "weight updates pushed by the trainer", labels=["reason"])
        seconds = CounterMetricFamily(
            "relayrl_weight_sync_seconds", "summed wall time of weight updates", labels=["reason"]
        )
        for reason in sorted(ctl.syncs.count):
            syncs.add_metric([reason], ctl.syncs.count[reason])
            seconds.add_metric([reason], ctl.syncs.seconds[reason])
        yield from (syncs, seconds)
        yield gauge(
            "relayrl_weight_sync_last_seconds", "duration of the last step's weight sync", status.last_sync_seconds
        )
        evals = GaugeMetricFamily(
            "relayrl_eval", "the latest held-out eval of each set, by metric (eval.sets)", labels=["set", "metric"]
        )
        eval_version = GaugeMetricFamily(
            "relayrl_eval_policy_version", "the policy version the latest eval of each set measured", labels=["set"]
        )
        for result in status.evals:
            eval_version.add_metric([result.name], result.policy_version)
            for key, value in sorted(result.metrics.items()):
                evals.add_metric([result.name, key], value)
        yield from (evals, eval_version)
        buckets, count, total = ctl.dispatcher.generate_seconds.snapshot()
        yield HistogramMetricFamily(
            "relayrl_generate_seconds",
            "Generate calls to rollout workers, from the call to its stream's end, as the controller sees them",
            buckets=[(repr(bound), n) for bound, n in buckets] + [("+Inf", count)],
            sum_value=total,
        )


class RolloutCollector(Collector):
    """A rollout worker's state at scrape time (its Stats)."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator:
        stats = self.worker.stats(False)
        labels = {"worker": stats.worker_id}
        tokens = CounterMetricFamily("relayrl_rollout_generated_tokens", "tokens generated", labels=["worker"])
        tokens.add_metric([stats.worker_id], stats.generated_tokens)
        yield tokens
        counts = self.worker.engine.prefill_counts()
        if counts is not None:  # the prefix cache's hit rate: reused / (prefilled + reused)
            for name, text, value in (
                ("relayrl_rollout_prefill_tokens", "prompt tokens prefilled (forwarded)", counts.computed),
                ("relayrl_rollout_prefix_cache_tokens", "prompt tokens taken from the prefix KV cache", counts.reused),
            ):
                family = CounterMetricFamily(name, text, labels=["worker"])
                family.add_metric([stats.worker_id], value)
                yield family
        yield gauge(
            "relayrl_rollout_tokens_per_second", "generated tokens/s (10 s window)", stats.tokens_per_second, labels
        )
        yield gauge("relayrl_rollout_active_requests", "Generate calls running", stats.active_requests, labels)
        yield gauge("relayrl_rollout_policy_version", "loaded policy version (-1: torn)", stats.policy_version, labels)
        yield gauge(
            "relayrl_rollout_last_update_seconds", "duration of the last weight load", stats.last_update_seconds, labels
        )
        state = GaugeMetricFamily("relayrl_rollout_state", "1 for the worker's state", labels=["worker", "state"])
        state.add_metric([stats.worker_id, stats.state], 1.0)
        yield state


class MetricsEndpoint:
    """``--metrics-port``: a registry, the RPC interceptor to pass to GrpcServer, and the HTTP endpoint.

    Usage: ``m = MetricsEndpoint(port)``; ``GrpcServer(..., interceptors=m.interceptors)``;
    ``m.start(collector)`` once the role's object exists. Port 0 or None: disabled (no interceptor)."""

    def __init__(self, port: int | None, host: str = METRICS_HOST) -> None:
        self.port, self.host = port or 0, host
        self.registry = new_registry()
        self.interceptors = [RpcMetricsInterceptor(self.registry)] if self.port else []
        self._http = None

    def start(self, collector: Collector) -> None:
        if not self.port:
            return
        self.registry.register(collector)
        try:
            self._http, _thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as err:  # taken since the start-up check (relayrl/cli.py): the same one line
            raise ConfigError(f"--metrics-port: {self.host}:{self.port} is in use ({err.strerror})") from None

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
