"""Served rewards: ``controller.reward.fns`` key ``scorer:<name>`` scores a group on the scorer ``scorers.<name>``
(ScorerService, ``relayrl reward serve``) instead of in the controller.

A group is one Score call with each response's conversation (the scorer re-renders it with its own template). The
call runs under the one retry policy (relayrl/rpc/retry.py: UNAVAILABLE and a try's DEADLINE_EXCEEDED are tried
again, each try on the next of the scorer's servers, until ``timeout_s``), so a scorer that dies and is restarted,
or has a live replica, loses nothing. Any other answer (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, INTERNAL), or a
scorer unreachable for ``timeout_s``, raises: the group fails with the scorer's message, and a scorer that keeps
failing stops the run under ``controller.reward.max_failed_share`` as a reward function does.

``normalize``: each score becomes (x - mean) / std over every score the scorer has given this run so far (this
call's included; Welford's running moments); std 0 (one distinct value so far) leaves x - mean.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Sequence

import grpc

from relayrl.config import ScorerConfig
from relayrl.rpc.channels import open_channel
from relayrl.rpc.retry import SERVICES
from relayrl.v1 import environment_pb2, scorer_pb2, scorer_pb2_grpc


class ScorerFailed(RuntimeError):
    """A scorer answered an error, or was unreachable for its whole deadline."""


class RunningMoments:
    """Mean and variance of every value seen (Welford), thread-safe."""

    def __init__(self) -> None:
        self.count, self.mean, self._m2 = 0, 0.0, 0.0
        self._lock = threading.Lock()

    def normalized(self, values: Sequence[float]) -> list[float]:
        """Add ``values``, then each as (x - mean) / std (population std; 0: x - mean)."""
        with self._lock:
            for x in values:
                self.count += 1
                delta = x - self.mean
                self.mean += delta / self.count
                self._m2 += delta * (x - self.mean)
            mean, std = self.mean, math.sqrt(self._m2 / self.count) if self.count else 0.0
        return [(x - mean) / std if std > 0 else x - mean for x in values]


class ScorerClient:
    """Calls scorer ``name``'s servers (``cfg.servers``) in turn, under the SERVICES retry policy."""

    def __init__(self, name: str, cfg: ScorerConfig) -> None:
        if not cfg.servers:
            raise ValueError(f"scorers.{name}.servers: no address to call (relayrl up fills it in for replicas)")
        self.name, self.cfg = name, cfg
        self._stubs = [scorer_pb2_grpc.ScorerServiceStub(open_channel(a)) for a in cfg.servers]
        self._turn = itertools.count()
        self.moments = RunningMoments() if cfg.normalize else None
        self._lock = threading.Lock()
        self._calls = self._tries = 0  # since step_metrics last read them
        self._seconds = 0.0

    @property
    def servers(self) -> list[str]:
        with self._lock:
            return list(self.cfg.servers)

    def add_server(self, address: str) -> int:
        """Call ``address`` too (a scorer that registered; one listed already: nothing); the servers now."""
        with self._lock:
            if address not in self.cfg.servers:
                self.cfg = self.cfg.model_copy(update={"servers": [*self.cfg.servers, address]})
                self._stubs.append(scorer_pb2_grpc.ScorerServiceStub(open_channel(address)))
            return len(self._stubs)

    def remove_server(self, address: str) -> int:
        """Stop calling ``address`` (a scorer that stops), unless it is the last; the servers now."""
        with self._lock:
            if address in self.cfg.servers and len(self._stubs) > 1:
                i = self.cfg.servers.index(address)
                self.cfg = self.cfg.model_copy(update={"servers": [a for a in self.cfg.servers if a != address]})
                del self._stubs[i]
            return len(self._stubs)

    def _call(self, method: str, request):
        tries = 0

        def attempt(left_s: float):
            nonlocal tries
            tries += 1
            with self._lock:
                stub = self._stubs[next(self._turn) % len(self._stubs)]
            return getattr(stub, method)(request, timeout=left_s)

        started = time.monotonic()
        try:
            return SERVICES.call(attempt, deadline_s=self.cfg.timeout_s, what=f"scorer {self.name}")
        except grpc.RpcError as err:
            raise ScorerFailed(f"scorer {self.name}: {err.code().name}: {err.details()}") from None
        finally:
            with self._lock:
                self._calls, self._tries = self._calls + 1, self._tries + tries
                self._seconds += time.monotonic() - started

    def score(self, conversations: Sequence[Sequence[dict]]) -> list[float]:
        """One score per conversation (each ending with its response), normalised when ``cfg.normalize``."""
        items = [
            scorer_pb2.ScoreItem(
                messages=[environment_pb2.ChatMessage(role=m["role"], content=str(m.get("content", ""))) for m in c]
            )
            for c in conversations
        ]
        scores = list(self._call("Score", scorer_pb2.ScoreRequest(items=items)).scores)
        return self.moments.normalized(scores) if self.moments is not None else scores

    def token_logprobs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """The teacher's log-prob of each response token, for (prompt ids, response ids) pairs."""
        items = [scorer_pb2.ScoreItem(prompt_token_ids=p, response_token_ids=r) for p, r in pairs]
        answer = self._call("TokenLogprobs", scorer_pb2.TokenLogprobsRequest(items=items))
        return [list(item.logprobs) for item in answer.items]

    def describe_servers(self, timeout_s: float = 1.0) -> list[tuple[str, scorer_pb2.DescribeResponse | str]]:
        """(address, its Describe answer, or why there is none) for each server, one try each."""
        answers = []
        with self._lock:
            servers = list(zip(self.cfg.servers, self._stubs))
        for address, stub in servers:
            try:
                answers.append((address, stub.Describe(scorer_pb2.DescribeRequest(), timeout=timeout_s)))
            except grpc.RpcError as err:
                answers.append((address, f"{err.code().name}: {err.details()}"))
        return answers

    def step_metrics(self) -> dict[str, float]:
        """The calls since the last read (latency_s: their mean seconds, retries included; calls; retries) and the
        servers' batching now (batch_size: items per model call, averaged over the servers that answered; queued)."""
        with self._lock:
            calls, tries, seconds = self._calls, self._tries, self._seconds
            self._calls = self._tries = 0
            self._seconds = 0.0
        metrics = {
            "calls": float(calls),
            "retries": float(tries - calls),
            "latency_s": seconds / calls if calls else 0.0,
        }
        answered = [a for _, a in self.describe_servers() if not isinstance(a, str)]
        if answered:
            metrics["batch_size"] = sum(a.mean_batch_size for a in answered) / len(answered)
            metrics["queued"] = float(sum(a.queued for a in answered))
        return metrics
