"""Trainer rank 0's copy of the controller's held-out evals into metrics.jsonl and the trackers (once each).

The controller runs the evals (relayrl/controller/evaluation.py) and keeps their results; after each step rank 0
asks for the new ones (GetEvals) and writes each as an eval line of metrics.jsonl (``eval``: the set, ``step``: the
version it measured). At the end of the run it waits for the evals still queued or running (the last version's),
so the run's files hold them before the reward PNG is drawn. With ``eval.best``, each result is offered to the
BestKeeper (relayrl/trainer/best.py).
"""

from __future__ import annotations

import logging
import time

import grpc

from relayrl.trainer.best import BestKeeper
from relayrl.trainer.metrics import MetricsWriter, eval_record, read_evals
from relayrl.trainer.trackers import StepTrackers
from relayrl.v1 import controller_pb2

log = logging.getLogger(__name__)


class EvalMirror:
    def __init__(self, stub, writer: MetricsWriter, trackers: StepTrackers, best: BestKeeper | None = None) -> None:
        self.stub = stub
        self.best = best
        self.writer = writer
        self.trackers = trackers
        self.logged = {(r["eval"], r["step"]) for r in read_evals(writer.path)}  # kept across a resume

    def poll(self, step: int) -> int:
        """Write the results not written yet (``step``: the trainer's last step, the trackers' x); returns how
        many evals the controller still has queued or running (-1: it could not be asked)."""
        try:
            answer = self.stub.GetEvals(controller_pb2.GetEvalsRequest(), timeout=30)
        except grpc.RpcError as err:
            log.warning("GetEvals: %s: %s (eval results are copied at the next step)", err.code().name, err.details())
            return -1
        for result in answer.results:
            if (result.name, result.policy_version) in self.logged:
                continue
            record = eval_record(result)
            self.writer.write_eval(record)
            self.trackers.log_eval(record, step)
            if self.best is not None:
                self.best.offer(record)
            self.logged.add((result.name, result.policy_version))
        return answer.pending

    def drain(self, step: int, timeout_s: float) -> None:
        """Poll until no eval is queued or running, at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.poll(step) != 0:
            if time.monotonic() > deadline:
                log.warning("evals still running after %.0fs: the run ends without them", timeout_s)
                return
            time.sleep(0.5)
