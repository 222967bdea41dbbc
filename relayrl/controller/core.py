"""The controller's state machine: dataset cursor, batches, ledger, versions, workers.

Batch production (one background thread): the batch for trainer step ``s`` may only hold
trajectories of policy version >= s - 1 - K (K = ``max_staleness``), so its generation starts once
the trainer has reported version s - 1 - K. K = 0 is the synchronous, on-policy loop.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from relayrl.config import RelayConfig
from relayrl.controller.dispatch import Dispatcher, PromptJob
from relayrl.controller.ledger import FAILED, FILTERED, PENDING, QUEUED, TRAINED, Ledger
from relayrl.controller.scoring import ScoredGroup, Scorer
from relayrl.controller.workers import WorkerRegistry
from relayrl.data.dataset import PromptDataset
from relayrl.errors import FailedPrecondition, NotFound, Unavailable
from relayrl.rollout.sampling import SamplingParams
from relayrl.trainer.algorithms.dynamic_sampling import DynamicSamplingExhausted, GroupFiller
from relayrl.v1 import controller_pb2

log = logging.getLogger(__name__)


@dataclass
class ProgressState:
    """What survives a controller restart (state.json)."""

    cursor: int = 0  # dataset draws so far
    trainer_step: int = 0  # last step the trainer reported
    policy_version: int = 0  # version on the workers after that step
    last_sync_seconds: float = 0.0
    last_sync_unix: float = 0.0


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class Controller:
    def __init__(self, cfg: RelayConfig, *, state_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        ccfg = cfg.controller
        self.state_dir = Path(state_dir or ccfg.state_dir or cfg.run_dir / "controller")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.dataset = PromptDataset(cfg.data, self.tokenizer, seed=cfg.run.seed)
        self.ledger = Ledger(self.state_dir / "ledger.jsonl")
        self.progress = self._load_progress()
        self.registry = WorkerRegistry(ccfg.worker_timeout_s)
        self.dispatcher = Dispatcher(
            self.registry, chunk_size=ccfg.dispatch_chunk, generate_timeout_s=ccfg.generate_timeout_s
        )
        self.scorer = Scorer(ccfg.reward, self.tokenizer, cfg.rollout.max_tokens)
        self.params = SamplingParams(
            n=cfg.rollout.n,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_tokens=cfg.rollout.max_tokens,
            stop_token_ids=tuple(cfg.rollout.stop_token_ids),
        )
        self.state = "running"
        self.error = ""
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._batches: dict[int, controller_pb2.Batch] = {}
        self._next_step = self.progress.trainer_step + 1
        self._fail_unfinished_prompts()
        self._threads = [
            threading.Thread(target=self._produce_loop, name="producer", daemon=True),
            threading.Thread(target=self._reap_loop, name="reaper", daemon=True),
        ]

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        self.ledger.close()

    def _load_progress(self) -> ProgressState:
        path = self.state_dir / "state.json"
        return ProgressState(**json.loads(path.read_text())) if path.exists() else ProgressState()

    def _save_progress(self) -> None:
        write_json_atomic(self.state_dir / "state.json", self.progress.__dict__)

    def _fail_unfinished_prompts(self) -> None:
        """After a restart, prompts that were in flight or in an unreported batch cannot be trained."""
        for state in (PENDING, QUEUED):
            ids = self.ledger.ids_in(state)
            if ids:
                self.ledger.mark(ids, FAILED, "controller restarted before the prompt was trained")

    # -- workers -------------------------------------------------------------------------------
    def _reap_loop(self) -> None:
        while not self._stop.wait(1.0):
            for worker_id in self.registry.reap():
                log.warning("worker %s missed heartbeats for %.0fs: dropped", worker_id, self.registry.timeout_s)

    # -- batch production ----------------------------------------------------------------------
    def _may_produce(self, step: int) -> bool:
        staleness = self.cfg.controller.max_staleness
        return (
            self.state == "running"
            and self.progress.policy_version >= step - 1 - staleness
            and len(self._batches) <= staleness
        )

    def _produce_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                step = self._next_step
                if not self._may_produce(step):
                    self._cond.wait(0.5)
                    continue
            try:
                batch = self._build_batch(step)
            except DynamicSamplingExhausted as err:
                self._fail(str(err))
                return
            if batch is None:
                continue
            with self._cond:
                self._batches[step] = batch
                self._next_step = step + 1
                self._save_progress()
                self._cond.notify_all()

    def _fail(self, message: str) -> None:
        log.error("run failed: %s", message)
        with self._cond:
            self.state, self.error = "failed", message
            self._cond.notify_all()

    def _draw(self, count: int) -> list:
        records = [self.dataset.record(self.progress.cursor + i) for i in range(count)]
        self.progress.cursor += count
        self.ledger.mark([r.prompt_id for r in records], PENDING)
        return records

    def _build_batch(self, step: int) -> controller_pb2.Batch | None:
        """Generate until ``train_batch_groups`` informative groups are kept (DAPO dynamic sampling)."""
        ccfg = self.cfg.controller
        required = max(0, step - 1 - ccfg.max_staleness)
        filler: GroupFiller[ScoredGroup] = GroupFiller(
            ccfg.train_batch_groups, ccfg.max_gen_batches, enabled=ccfg.dynamic_sampling
        )
        start = time.monotonic()
        all_groups: list[ScoredGroup] = []
        stale = failed = 0
        drawn: list[str] = []
        try:
            while not filler.is_full:
                records = self._draw(ccfg.prompts_per_gen_batch)
                drawn += [r.prompt_id for r in records]
                result = self.dispatcher.run(
                    [PromptJob(r.prompt_id, r.token_ids) for r in records],
                    self.params,
                    min_version=required,
                    should_stop=self._stop.is_set,
                )
                for prompt_id, reason in result.failed.items():
                    self.ledger.mark([prompt_id], FAILED, reason, step)
                failed += len(result.failed)
                if self._stop.is_set():
                    return None
                groups = [
                    self.scorer.group(r, result.groups[r.prompt_id]) for r in records if r.prompt_id in result.groups
                ]
                fresh = [g for g in groups if g.min_version >= required]
                for g in groups:
                    if g.min_version < required:
                        self.ledger.mark(
                            [g.record.prompt_id], FILTERED, f"stale: version {g.min_version} < {required}", step
                        )
                stale += len(groups) - len(fresh)
                all_groups += fresh
                dropped = filler.add_batch(fresh, [g.rewards for g in fresh])
                self.ledger.mark([g.record.prompt_id for g in dropped], FILTERED, "all rewards equal", step)
        except DynamicSamplingExhausted as err:
            leftover = [pid for pid in drawn if (self.ledger.state(pid) or ("",))[0] == PENDING]
            self.ledger.mark(leftover, FAILED, "dynamic sampling exhausted", step)
            raise err
        kept = filler.take()
        self.ledger.mark([g.record.prompt_id for g in filler.surplus], FILTERED, "surplus beyond the batch", step)
        return self._batch_message(step, kept, all_groups, filler, stale, failed, time.monotonic() - start)

    def _batch_message(self, step, kept, all_groups, filler, stale, failed, seconds) -> controller_pb2.Batch:
        samples = [
            controller_pb2.Sample(
                prompt_id=g.record.prompt_id,
                group=gi,
                prompt_token_ids=g.record.token_ids,
                response_token_ids=c.token_ids,
                rollout_logprobs=c.logprobs,
                reward=reward,
                score=score,
                finish_reason=c.finish_reason,
                policy_version=c.policy_version,
            )
            for gi, g in enumerate(kept)
            for c, reward, score in zip(g.completions, g.rewards, g.scores)
        ]
        every = [(r, s, len(c.token_ids)) for g in all_groups for c, r, s in zip(g.completions, g.rewards, g.scores)]
        versions = [s.policy_version for s in samples]
        stats = controller_pb2.BatchStats(
            groups_kept=len(kept),
            groups_filtered=filler.dropped_count,
            gen_batches=filler.gen_batches,
            rollout_version_min=min(versions),
            rollout_version_max=max(versions),
            generation_seconds=seconds,
            reward_mean=sum(e[0] for e in every) / len(every),
            score_mean=sum(e[1] for e in every) / len(every),
            samples_generated=len(every),
            response_len_mean=sum(e[2] for e in every) / len(every),
            groups_stale=stale,
            groups_failed=failed,
        )
        return controller_pb2.Batch(
            batch_id=f"{step}-{uuid.uuid4().hex[:8]}",
            step=step,
            samples=samples,
            stats=stats,
            temperature=self.params.temperature,
        )

    # -- trainer-facing ------------------------------------------------------------------------
    def pull_batch(self, step: int, timeout_s: float) -> controller_pb2.Batch:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if step > self._next_step and not self._batches:
                self._next_step = step  # a trainer resumed ahead of this controller's state
                self._cond.notify_all()
            while step not in self._batches:
                if self.state == "failed":
                    raise FailedPrecondition(self.error)
                if step <= self.progress.trainer_step:
                    raise FailedPrecondition(
                        f"step: {step} was already trained (last step {self.progress.trainer_step})"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Unavailable(f"no batch for step {step} within {timeout_s:.0f}s; retry")
                self._cond.wait(min(remaining, 1.0))
            batch = self._batches[step]
        self.ledger.mark(sorted({s.prompt_id for s in batch.samples}), QUEUED, step=step)
        return batch

    def report_step(self, request: controller_pb2.ReportStepRequest) -> None:
        with self._cond:
            batch = self._batches.get(request.step)
            if batch is None or batch.batch_id != request.batch_id:
                raise NotFound(f"batch_id: {request.batch_id!r} is not the pending batch of step {request.step}")
            del self._batches[request.step]
            self.progress.trainer_step = request.step
            self.progress.policy_version = request.policy_version
            self.progress.last_sync_seconds = request.sync_seconds
            self.progress.last_sync_unix = time.time()
            if request.step >= self.cfg.trainer.steps:
                self.state = "finished"
            self._save_progress()
            self._cond.notify_all()
        self.registry.set_versions(list(request.synced_worker_ids), request.policy_version)
        self.ledger.mark(sorted({s.prompt_id for s in batch.samples}), TRAINED, step=request.step)

    def sync_plan(self) -> controller_pb2.WeightSyncPlan:
        return controller_pb2.WeightSyncPlan(
            workers=[
                controller_pb2.WorkerEndpoint(worker_id=w.worker_id, address=w.address, policy_version=w.policy_version)
                for w in sorted(self.registry.active(), key=lambda w: w.worker_id)
            ]
        )

    # -- operators -----------------------------------------------------------------------------
    def status(self) -> controller_pb2.StatusResponse:
        counts = self.ledger.counts()
        return controller_pb2.StatusResponse(
            run_name=self.cfg.run.name,
            state=self.state,
            trainer_step=self.progress.trainer_step,
            policy_version=self.progress.policy_version,
            workers=[
                controller_pb2.WorkerStatus(
                    worker_id=w.worker_id,
                    address=w.address,
                    engine=w.engine,
                    state=w.state,
                    policy_version=w.policy_version,
                    in_flight=w.in_flight,
                    tokens_per_second=w.tokens_per_second,
                )
                for w in self.registry.snapshot()
            ],
            ledger=controller_pb2.LedgerCounts(
                dispatched=len(self.ledger),
                trained=counts.get(TRAINED, 0),
                filtered=counts.get(FILTERED, 0),
                failed=counts.get(FAILED, 0),
                pending=counts.get(PENDING, 0) + counts.get(QUEUED, 0),
            ),
            last_sync_seconds=self.progress.last_sync_seconds,
            last_sync_unix=self.progress.last_sync_unix,
            error=self.error,
            dataset_cursor=self.progress.cursor,
        )
