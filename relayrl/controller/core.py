"""The controller's state machine: dataset cursor, batches, ledger, versions, workers.

Batch production (one background thread): the batch for trainer step ``s`` may only hold
trajectories of policy version >= s - 1 - K (K = ``max_staleness``), so its generation starts once
the trainer has reported version s - 1 - K. K = 0 is the synchronous, on-policy loop.

Streaming (``RelayConfig.streams``, K = 0): step s's kept groups are handed to the trainer's StreamBatch as
they are kept, so it trains while the rest generates. Every streamed group must be exactly on-policy with
verified engine logprobs, so the step's prompts go only to the workers whose load of version s - 1 was
verified: the ones the trainer reported for that version (ReportStep, its first publish, Rewind). A worker
that joins later (a scale-up, a restart) gets no streamed work until the next step's publish, which
includes it; when none of the verified workers is ready at the step's start, that step is built whole from
any worker and trained whole (old logprobs recomputed where not exact).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from transformers import AutoTokenizer

from relayrl.algorithms.dynamic_sampling import DynamicSamplingExhausted, GroupFiller
from relayrl.algorithms.partition import minibatch_groups
from relayrl.algorithms.routing_replay import routed_experts_problem
from relayrl.algorithms.version_mix import sampled_versions
from relayrl.client.workers import DRAINING, WorkerRegistry
from relayrl.config import RelayConfig
from relayrl.controller.dispatch import Dispatcher, PromptJob
from relayrl.controller.evaluation import Evaluator
from relayrl.controller.fanout import fan_out
from relayrl.controller.ledger import FAILED, FILTERED, PENDING, QUEUED, TERMINAL, TRAINED, Ledger
from relayrl.controller.pace import Pace
from relayrl.controller.scoring import ScoredGroup, Scorer
from relayrl.controller.weight_syncs import WeightSyncLog
from relayrl.cores.threads import evals_first
from relayrl.data.dataset import PromptDataset, PromptRecord
from relayrl.data.vocab import check_teacher_vocab
from relayrl.episodes.runner import EpisodeRunner
from relayrl.episodes.stats import fill_episode_stats
from relayrl.errors import (
    NOT_READY_DETAIL,
    PAUSED_DETAIL,
    RUN_STOPPED_DETAIL,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from relayrl.rewards import RewardFailures, RewardRaised, RewardShapeError
from relayrl.runtime.files import atomic_write
from relayrl.runtime.repeats import RepeatedWarning
from relayrl.v1 import common_pb2, controller_pb2, rollout_pb2

log = logging.getLogger(__name__)
STATS_PER_ROUND = 128  # Stats calls per poll (a call to an idle channel costs controller CPU): larger fleets in turns


@dataclass
class ProgressState:
    """What survives a controller restart (state.json)."""

    cursor: int = 0  # dataset draws so far
    trainer_step: int = 0  # last step the trainer reported
    policy_version: int = 0  # version on the workers after that step
    last_sync_seconds: float = 0.0
    last_sync_unix: float = 0.0
    desired_rollout_replicas: int = 0  # set by ScaleRollout; 0 = never set
    desired_scorer_replicas: dict[str, int] = field(default_factory=dict)  # scorer name -> ScaleScorer's count
    exact_workers: list[str] = field(default_factory=list)  # workers verified at exact_version (streaming)
    exact_version: int = -1
    last_batch_id: str = ""  # the batch of ``trainer_step``: a repeated ReportStep of it is answered, not refused


def episode_ends(groups: dict[str, list]) -> dict[str, list[str]]:
    """Prompt id -> how each episode of its group ended ("failed: <why>" for a failed one): the ledger's notes."""
    return {pid: [f"failed: {e.reason}" if e.failed else e.end for e in group] for pid, group in groups.items()}


def reward_means(groups: list[ScoredGroup]) -> dict[str, float]:
    """Each reward function's mean value over the samples of ``groups`` that it scored."""
    values: dict[str, list[float]] = {}
    for group in groups:
        for name, part in group.parts.items():
            values.setdefault(name, []).extend(part)
    return {name: sum(v) / len(v) for name, v in values.items() if v}


class _Abandoned(Exception):
    """The run was rewound while a batch was being built: that batch is void."""


@dataclass
class _Build:
    """One batch in production: its dynamic-sampling filler and what it saw."""

    step: int
    required: int  # oldest policy version allowed
    filler: GroupFiller[ScoredGroup]
    streamed: bool  # kept groups go to the trainer's stream as they are kept
    all_groups: list[ScoredGroup] = field(default_factory=list)  # every fresh group, filtered or not
    drawn: list[str] = field(default_factory=list)
    stale: int = 0
    failed: int = 0
    aborted: int = 0  # completions the workers aborted (their prompts generated again)
    kept: int = 0
    closed: bool = False  # between generation rounds: late group callbacks are ignored
    reward_error: RewardShapeError | None = None  # a reward function's wrong return: the round stops, the run fails
    scored: int = 0  # groups given to the reward function
    reward_raised: list[RewardRaised] = field(default_factory=list)  # of those, the ones whose function raised
    filtered: dict[str, list[str]] = field(default_factory=dict)  # reason -> prompt ids: the round's, to record
    episodes: list = field(default_factory=list)  # agentic runs: every episode that ended (BatchStats 35-42)
    too_long: int = 0  # prompts drawn and filtered as longer than data.max_prompt_tokens
    truncated: int = 0  # prompts drawn and cut to data.max_prompt_tokens


def unreplayable(record: PromptRecord, completions: list[common_pb2.Completion]) -> str | None:
    """Why a group's routed experts cannot be replayed by the trainer (routing replay: every completion carries
    its prompt's and response's, the last token's aside); None: they can. The group then fails with this reason
    in the ledger, where a batch holding it would stop the trainer."""
    for c in completions:
        if not c.HasField("routed_experts"):
            return f"completion {c.sample_index}: no routed_experts (algorithm.routing_replay)"
        tokens = len(record.token_ids) + len(c.token_ids) - 1
        if problem := routed_experts_problem(c.routed_experts, tokens):
            return f"completion {c.sample_index}: {problem}"
    return None


class Controller:
    def __init__(self, cfg: RelayConfig, *, state_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        ccfg = cfg.controller
        self.state_dir = Path(state_dir or ccfg.state_dir or cfg.run_dir / "controller")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        if cfg.algorithm.teacher is not None:  # it scores this tokenizer's ids
            check_teacher_vocab(self.tokenizer, cfg.algorithm.teacher, cfg.scorers[cfg.algorithm.teacher].model)
        self.dataset = PromptDataset(cfg.data, self.tokenizer, seed=cfg.run.seed)
        self.ledger = Ledger(self.state_dir / "ledger.jsonl")
        self.progress = self._load_progress()
        self.registry = WorkerRegistry(ccfg.worker_timeout_s, max_in_flight=ccfg.worker_max_calls)
        self.dispatcher = Dispatcher(
            self.registry,
            chunk_size=ccfg.dispatch_chunk,
            generate_timeout_s=ccfg.generate_timeout_s,
            max_threads=ccfg.max_workers * self.registry.max_in_flight,  # a thread per call every worker may hold
            straggler_factor=ccfg.straggler_factor,
        )
        self.scorer = Scorer(
            ccfg.reward, self.tokenizer, cfg.max_response_tokens, self.dataset.row,
            stop=cfg.rollout.stop, include_stop=cfg.rollout.include_stop_str_in_output, scorers=cfg.scorers,
            teacher=cfg.algorithm.teacher,
        )  # fmt: skip
        self.params = cfg.rollout.sampling()
        # single-turn training calls, seeded from run.seed under rollout.seed_requests (each its own seed: Dispatcher)
        self.call_params = replace(self.params, seed=cfg.run.seed) if cfg.seeds_requests else self.params
        # agentic runs: episodes against the environment servers instead of single completions (relayrl/episodes)
        self.episodes = (
            EpisodeRunner(cfg, self.registry, self.tokenizer, self.params, self.dataset.row)
            if cfg.environment
            else None
        )
        # held-out evals, each at one policy version (relayrl/controller/evaluation.py)
        self.evaluator = None
        self._evals_first = bool(cfg.eval) and evals_first(cfg)  # the trainer waits for them (cores.threads)
        if cfg.eval:  # deferred past the generation of an unstreamed batch trained from its version, unless the
            # trainer waits for it (``_evals_first``: it then runs beside that generation instead)
            deferred = not cfg.streams and not self._evals_first
            defer = self._batch_generating_from if deferred else lambda version: False
            self.evaluator = Evaluator(cfg, self.registry, self.tokenizer, self.state_dir, defer)
        self.state = "running"
        self.error = ""
        self.syncs = WeightSyncLog()
        self.pace = Pace()
        self.step_metrics: dict[str, float] = {}  # the last reported step's metrics (ReportStepRequest.metrics)
        self.repeats = RepeatedWarning(log)  # per-step warnings: once every 10 with a count
        self.drained: set[str] = set()  # worker ids an operator drained; forgotten when the id registers anew
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._epoch = 0  # bumped by rewind(): batches begun in an older epoch are void
        self._batch_dir = self.state_dir / "batches"
        self._batch_dir.mkdir(exist_ok=True)
        self._settled: list[Path] = []  # files of reported batches whose TRAINED events are not fsynced yet
        self._batches: dict[int, controller_pb2.Batch] = self._load_batches()
        self._streams: dict[int, list[controller_pb2.Sample]] = {}  # step being built streamed -> kept samples
        self._next_step = max([self.progress.trainer_step, *self._batches]) + 1
        self._building: int | None = None  # the step whose batch the producer builds now
        self._skip_recorded_draws()
        self._fail_unfinished_prompts()
        self._sync_ledger()
        self._threads = [
            threading.Thread(target=self._produce_loop, name="producer", daemon=True),
            threading.Thread(target=self._reap_loop, name="reaper", daemon=True),
            threading.Thread(target=self._stats_loop, name="worker-stats", daemon=True),
        ]

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        for thread in self._threads:
            thread.start()
        if self.evaluator is not None:
            self.evaluator.start()
            if self.progress.exact_version >= 0 or self.progress.trainer_step > 0:  # its weights are out
                self.evaluator.request(self.progress.policy_version)  # due and not done: cut by a restart

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        if self.evaluator is not None:
            self.evaluator.stop()
        if self.episodes is not None:
            self.episodes.close()
        self._sync_ledger()
        self.ledger.close()

    def _load_progress(self) -> ProgressState:
        path = self.state_dir / "state.json"
        return ProgressState(**json.loads(path.read_text())) if path.exists() else ProgressState()

    def _save_progress(self) -> None:
        atomic_write(self.state_dir / "state.json", json.dumps(self.progress.__dict__))

    def _load_batches(self) -> dict[int, controller_pb2.Batch]:
        """Batches produced but not yet reported survive a restart (the trainer may be training one)."""
        batches = {}
        for path in self._batch_dir.glob("step_*.pb"):
            batch = controller_pb2.Batch.FromString(path.read_bytes())
            if batch.step > self.progress.trainer_step:
                batches[batch.step] = batch
            else:  # reported, and the process died before its ledger entries and file were settled
                self._settle_reported(batch)
        return batches

    def _settle_reported(self, batch: controller_pb2.Batch) -> None:
        """The second half of a report, after state.json records it (the commit point): the batch's prompts
        become TRAINED in the ledger (those a crash left unsettled); its file goes once they are durable."""
        versions: dict[str, Counter[int]] = {}
        for sample in batch.samples:
            versions.setdefault(sample.prompt_id, Counter()).update(sampled_versions(sample))
        unsettled = [pid for pid in sorted(versions) if (self.ledger.state(pid) or ("",))[0] not in TERMINAL]
        self.ledger.mark(unsettled, TRAINED, step=batch.step, token_versions=versions)
        self._settled.append(self._batch_dir / f"step_{batch.step}.pb")  # deleted by the next _sync_ledger

    def _sync_ledger(self) -> None:
        """fsync the ledger, then delete the files of the batches settled before it: a restart settles a batch
        from its file until its TRAINED events are durable (one fsync a step, with the report's write-ahead one)."""
        self.ledger.sync()
        for path in self._settled:
            path.unlink(missing_ok=True)
        self._settled.clear()

    def _persist_batch(self, batch: controller_pb2.Batch) -> None:
        atomic_write(self._batch_dir / f"step_{batch.step}.pb", batch.SerializeToString())

    def _skip_recorded_draws(self) -> None:
        """A draw is recorded in the ledger at once, the cursor only with the step's report: after a restart, the
        ledger holds prompts beyond the saved cursor (those of persisted batches included). Move the cursor past
        them (unfinished ones are failed next, those of persisted batches stay pending), so none is drawn twice."""
        start = self.progress.cursor
        while self.ledger.state(self.dataset.record(self.progress.cursor).prompt_id) is not None:
            self.progress.cursor += 1
        if self.progress.cursor != start:
            log.warning("dataset cursor %d -> %d: draws recorded before a crash", start, self.progress.cursor)
            self._save_progress()

    def _fail_unfinished_prompts(self) -> None:
        """After a restart, prompts that were mid-generation are lost work: fail them with the reason.
        Prompts of persisted batches stay pending: those batches are still handed out."""
        kept = {s.prompt_id for batch in self._batches.values() for s in batch.samples}
        for state in (PENDING, QUEUED):
            ids = [pid for pid in self.ledger.ids_in(state) if pid not in kept]
            if ids:
                self.ledger.mark(ids, FAILED, "controller restarted before the prompt was trained")

    # -- workers -------------------------------------------------------------------------------
    def _reap_loop(self) -> None:
        while not self._stop.wait(1.0):
            for worker_id in self.registry.reap():
                log.warning("worker %s missed heartbeats for %.0fs: dropped", worker_id, self.registry.timeout_s)

    def _stats_loop(self, interval_s: float = 2.0) -> None:
        """Keep each worker's token counters (Status, metrics) fresh from its Stats: every worker every
        ``interval_s`` up to STATS_PER_ROUND workers; a larger fleet in turns (1,000 workers: every 16 s)."""
        while not self._stop.wait(interval_s):
            workers = self.registry.rotation(STATS_PER_ROUND)
            responses, _ = fan_out(workers, "Stats", rollout_pb2.StatsRequest(), timeout_s=interval_s)
            for worker in workers:
                if worker.worker_id in responses:
                    worker.tokens_per_second = responses[worker.worker_id].tokens_per_second
                    worker.generated_tokens = responses[worker.worker_id].generated_tokens

    # -- batch production ----------------------------------------------------------------------
    def _may_produce(self, step: int) -> bool:
        staleness = self.cfg.controller.max_staleness
        return (
            self.state == "running"
            and self._starting_weights_in()
            and self.progress.policy_version >= step - 1 - staleness
            and len(self._batches) <= staleness
        )

    def _starting_weights_in(self) -> bool:
        """Rollouts wait for the trainer's starting weights in pause mode: their load aborts every call in flight,
        so a round begun before it was generated twice (and warned about once a call). Shadow mode swaps the
        weights in between calls, and in-flight updates (``rollout.partial``) let the calls run on over the load:
        nothing is lost by starting at once. The trainer's "initial" report, a Rewind
        and each ReportStep set ``exact_version`` (``_set_exact``), so it is >= 0 once the weights are out;
        ``trainer_step``: a run saved before ``exact_version`` existed."""
        progress = self.progress
        interrupts = self.cfg.weight_sync.mode == "pause" and self.cfg.rollout.partial == "off"
        return progress.exact_version >= 0 or progress.trainer_step > 0 or not interrupts

    def _batch_generating_from(self, version: int) -> bool:
        """The batch trained from ``version`` (step ``version`` + 1) generates now, or may start to."""
        with self._cond:
            step = version + 1
            return self._building == step or (self._next_step == step and self._may_produce(step))

    def _produce_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                step, epoch = self._next_step, self._epoch
                if not self._may_produce(step):
                    self._cond.wait(0.5)
                    continue
                self._building = step
            try:
                batch = self._build_batch(step, epoch)
            except DynamicSamplingExhausted as err:
                self._fail(str(err))
                continue
            except (RewardShapeError, RewardFailures) as err:  # deterministic: the next try would fail the same way
                trace = err.traceback if isinstance(err, RewardFailures) else "".join(traceback.format_exception(err))
                self._fail(f"{RUN_STOPPED_DETAIL}: step {step}: {err}", trace)
                continue
            except Exception as err:  # the run fails loudly (the trainer hears it), never hangs on a dead thread
                log.exception("batch production for step %d failed", step)
                self._fail(f"batch production for step {step} failed: {err}")
                continue  # a failed run produces nothing until a rewind (a restarted trainer) sets it running
            finally:
                with self._cond:
                    self._building = None
            with self._cond:
                self._streams.pop(step, None)  # its batch is stored below, under the same lock, or void
                if batch is None:
                    self._cond.notify_all()
                    continue
                if epoch != self._epoch:
                    self.ledger.rewind(sorted({s.prompt_id for s in batch.samples}), "batch voided by a rewind")
                    continue
                self._persist_batch(batch)  # with it, its draws are recovered from the ledger: no state.json save
                self._batches[step] = batch
                self._next_step = step + 1
                self._cond.notify_all()

    def _fail(self, message: str, trace: str = "") -> None:
        """The run fails with ``message`` (the trainer hears it); ``trace``: a traceback to log with it."""
        log.error("run failed: %s%s", message, f"\n{trace.rstrip()}" if trace else "")
        with self._cond:
            self.state, self.error = "failed", message
            self._cond.notify_all()

    def _draw(self, count: int, epoch: int) -> list:
        with self._cond:
            if epoch != self._epoch:
                raise _Abandoned
            records = self.dataset.records(self.progress.cursor, count)
            self.ledger.mark([r.prompt_id for r in records], PENDING)
            # The cursor is saved with the step's report, not here: the ledger holds every draw, so a restart
            # skips what was drawn since (_skip_recorded_draws). A save per draw put an open, fsync and rename
            # under this lock for each of the demo's ~16 rounds a step (18 fsyncs a step, now 1).
            self.progress.cursor += count
        return records

    def _build_batch(self, step: int, epoch: int) -> controller_pb2.Batch | None:
        """Generate until ``train_batch_groups`` informative groups are kept (DAPO dynamic sampling).

        Whole batches keep each round's groups in dataset order; streamed ones in the order they complete."""
        ccfg = self.cfg.controller
        required = max(0, step - 1 - ccfg.max_staleness)
        exact = self._exact_workers(required)
        filler = GroupFiller(ccfg.train_batch_groups, ccfg.max_gen_batches, enabled=ccfg.dynamic_sampling)
        build = _Build(step, required, filler, streamed=exact is not None)
        if build.streamed:
            with self._cond:
                self._streams[step] = []
        start = time.monotonic()
        cursor_start = self.progress.cursor
        offer_lock = threading.Lock()
        try:
            while not filler.is_full:
                records = self._draw(ccfg.prompts_per_gen_batch, epoch)
                build.drawn += [r.prompt_id for r in records]
                records = self._fit(build, records)
                by_id = {r.prompt_id: r for r in records}

                early: dict[str, ScoredGroup | None] = {}  # a whole batch's groups, scored as each completes

                def on_group(prompt_id, completions, by_id=by_id, early=early):
                    group = self._score(build, by_id[prompt_id], completions)
                    with offer_lock:
                        if not build.streamed:
                            early[prompt_id] = group  # offered below, in dataset order
                        elif group is not None and not build.closed:  # a call still running after a stop: settled below
                            self._offer(build, group)

                result = self._generate(
                    records,
                    min_version=required,
                    on_group=on_group,
                    should_stop=lambda: self._stop.is_set() or epoch != self._epoch or build.reward_error is not None,
                    only=exact,
                )
                with offer_lock:
                    build.closed = True
                if self.episodes is not None:
                    build.episodes += [e for group in result.episodes.values() for e in group]
                    self.ledger.record_episodes(episode_ends(result.episodes), step)
                if build.reward_error is not None:
                    raise build.reward_error
                for prompt_id, reason in result.failed.items():
                    self.ledger.mark([prompt_id], FAILED, reason, step)
                build.failed += len(result.failed)
                build.aborted += result.aborted
                if self._stop.is_set() or epoch != self._epoch:
                    raise _Abandoned
                build.closed = False
                if not build.streamed:
                    for r in records:
                        if r.prompt_id not in result.groups:
                            continue
                        with offer_lock:
                            scored = r.prompt_id in early
                            group = early.pop(r.prompt_id, None)
                        if not scored:
                            group = self._score(build, r, result.groups[r.prompt_id])
                        if group is not None:
                            self._offer(build, group)
                    if build.reward_error is not None:
                        raise build.reward_error
                self._check_reward_failures(build)
                with offer_lock:
                    self._record_filtered(build)
                filler.close_batch()
        except _Abandoned:
            self._record_filtered(build)  # before the rewind or the failing of what is still pending
            if epoch != self._epoch:
                self.ledger.rewind(build.drawn, "batch abandoned by a rewind")
            else:
                self._fail_pending(build, "controller shut down mid-generation")
            return None
        except (RewardShapeError, RewardFailures) as err:
            self._record_filtered(build)
            self._fail_pending(build, f"{RUN_STOPPED_DETAIL}: {err}")
            raise
        except DynamicSamplingExhausted as err:  # raised by close_batch, after the round's filtered were recorded
            shortfall = self._min_partial_groups() - len(filler.kept)
            if ccfg.on_exhausted == "fail" or len(build.all_groups) < self._min_partial_groups():
                self._fail_pending(build, "dynamic sampling exhausted")
                raise err
            self.repeats.warn(
                "dynamic sampling exhausted",
                "%s Step %d trains on the %d groups kept%s (on_exhausted: partial).", err, step, err.kept,
                f", topped up with {shortfall} whose rewards were all equal (zero advantage)" if shortfall > 0 else "",
            )  # fmt: skip
        kept = filler.take(partial=True)
        kept += self._top_up(build, kept)
        self.ledger.mark([g.record.prompt_id for g in filler.surplus], FILTERED, "surplus beyond the batch", step)
        batch = self._batch_message(build, kept, time.monotonic() - start)
        batch.stats.cursor_start, batch.stats.cursor_end = cursor_start, self.progress.cursor
        return batch

    def _fit(self, build: _Build, records: list[PromptRecord]) -> list[PromptRecord]:
        """The drawn prompts to generate: one longer than data.max_prompt_tokens is filtered (the ledger records its
        length) or was cut to it (data.long_prompts); both are counted in the batch's stats."""
        build.truncated += sum(1 for r in records if r.tokens_cut)
        for record in records:
            if record.too_long:
                build.filtered.setdefault(record.too_long, []).append(record.prompt_id)
                build.too_long += 1
        return [r for r in records if not r.too_long]

    def _check_reward_failures(self, build: _Build) -> None:
        """RewardFailures (the first error's message and traceback) once more of the step's scored groups failed
        their reward function than ``controller.reward.max_failed_share`` of them."""
        share = self.cfg.controller.reward.max_failed_share
        with self._cond:
            raised, scored = list(build.reward_raised), build.scored
        if len(raised) > share * scored:
            raise RewardFailures(
                f"{len(raised)} of the {scored} prompts scored failed their reward function (more than "
                f"controller.reward.max_failed_share = {share}); the first: {raised[0]}",
                "".join(traceback.format_exception(raised[0])),
            )

    def _fail_pending(self, build: _Build, reason: str) -> None:
        """Fail the build's drawn prompts that are still pending (not yet settled), with ``reason``."""
        pending = [pid for pid in build.drawn if (self.ledger.state(pid) or ("",))[0] == PENDING]
        self.ledger.mark(pending, FAILED, reason, build.step)

    def _score(self, build: _Build, record: PromptRecord, completions: list) -> ScoredGroup | None:
        """The scored group (an agentic run's ``completions`` are its Episodes: ``Scorer.episode_group``), or None: its
        reward function raised (the prompt fails with the reason) or returned a
        wrong shape (kept in ``build.reward_error``: the round stops and the run fails with it)."""
        if self.cfg.algorithm.routing_replay and (problem := unreplayable(record, completions)):
            log.warning("prompt %s failed: %s", record.prompt_id, problem)
            self.ledger.mark([record.prompt_id], FAILED, problem, build.step)
            with self._cond:
                build.failed += 1
            return None
        with self._cond:  # streamed groups are scored on dispatch threads
            build.scored += 1
        try:
            if self.episodes is not None:
                return self.scorer.episode_group(record, completions)
            return self.scorer.group(record, completions)
        except RewardRaised as err:
            log.warning("prompt %s failed: %s", record.prompt_id, err)
            self.ledger.mark([record.prompt_id], FAILED, str(err), build.step)
            with self._cond:
                build.failed += 1
                build.reward_raised.append(err)
        except RewardShapeError as err:
            build.reward_error = build.reward_error or err
        return None

    def _generate(self, records: list[PromptRecord], **how):
        """Samples for ``records``: ``rollout.n`` completions of each prompt (the dispatcher), or of an agentic run
        ``rollout.n`` episodes of each task (the episode runner). ``how``: min_version, on_group, should_stop,
        only; the result has ``groups`` and ``failed`` by prompt id."""
        if self.episodes is not None:
            return self.episodes.run(records, **how)
        return self.dispatcher.run([PromptJob(r.prompt_id, r.token_ids) for r in records], self.call_params, **how)

    def _offer(self, build: _Build, group: ScoredGroup) -> None:
        """One generated group: stale ones are filtered, the rest offered to dynamic sampling; a streamed
        batch's kept group (within the batch's size) joins the step's stream at once."""
        prompt_id = group.record.prompt_id
        if group.min_version < build.required:
            build.filtered.setdefault(f"stale: version {group.min_version} < {build.required}", []).append(prompt_id)
            build.stale += 1
            return
        build.all_groups.append(group)
        if not build.filler.offer(group, group.rewards):
            build.filtered.setdefault("all rewards equal", []).append(prompt_id)
            return
        build.kept += 1
        if build.streamed and build.kept <= build.filler.target_groups:
            self._stream(build, self._group_samples(build.kept - 1, group))

    def _record_filtered(self, build: _Build) -> None:
        """The ledger entries of the round's filtered groups: one write for each reason, not one a group (the
        demo's late steps filter ~120 groups each)."""
        for reason, prompt_ids in build.filtered.items():
            self.ledger.mark(prompt_ids, FILTERED, reason, build.step)
        build.filtered.clear()

    def _exact_workers(self, required: int) -> frozenset[str] | None:
        """The workers a streamed step may use (verified at version ``required``, ready), or None: this step is
        built whole (streaming off, or none of those workers ready)."""
        if not self.cfg.streams or self.progress.exact_version != required:
            return None
        ready = set(self.progress.exact_workers) & self.registry.ready_ids(required)
        return frozenset(ready) or None

    def _top_up(self, build: _Build, kept: list[ScoredGroup]) -> list[ScoredGroup]:
        """Groups that bring an exhausted partial batch up to ``_min_partial_groups``: the latest ones whose rewards
        were all equal. Their advantages are zero, so they add no policy gradient (only their tokens to a
        token-mean denominator): a policy that solves (or fails) every prompt keeps training instead of failing
        the run. A streamed step receives them like any kept group."""
        missing = self._min_partial_groups() - len(kept)
        if missing <= 0:
            return []
        taken = {id(g) for g in kept}
        extra = [g for g in reversed(build.all_groups) if id(g) not in taken][:missing]
        reason = "zero-advantage top-up of an exhausted batch"
        self.ledger.mark([g.record.prompt_id for g in extra], PENDING, reason, build.step, refilter=True)
        if build.streamed:
            self._stream(build, [s for i, g in enumerate(extra) for s in self._group_samples(len(kept) + i, g)])
        return extra

    def _stream(self, build: _Build, samples: list[controller_pb2.Sample]) -> None:
        """Append ``samples`` to the stream of ``build``'s step, if it is still open, and wake its reader."""
        with self._cond:
            if build.step in self._streams:
                self._streams[build.step].extend(samples)
                self._cond.notify_all()

    def _min_partial_groups(self) -> int:
        """Fewest groups a partial batch may hold: one per mini-batch, and a row for every trainer rank in each."""
        tcfg = self.cfg.trainer
        return max(tcfg.mini_batches, -(-tcfg.mini_batches * tcfg.nproc // self.cfg.rollout.n))

    @staticmethod
    def _group_samples(index: int, group: ScoredGroup) -> list[controller_pb2.Sample]:
        """The samples of the batch's group number ``index``. What the group's samples share (prompt id and
        tokens, group) is built once and merged into each, a copy in C rather than the prompt's tokens
        converted from Python once per sample (half the cost of a sample)."""
        shared = controller_pb2.Sample(prompt_id=group.record.prompt_id, group=index)
        shared.prompt_token_ids.extend(group.record.token_ids)
        samples = []
        teacher = group.teacher_logprobs or [[] for _ in group.completions]
        for c, reward, score, teacher_logprobs in zip(group.completions, group.rewards, group.scores, teacher):
            sample = controller_pb2.Sample(
                response_token_ids=c.token_ids,
                rollout_logprobs=c.logprobs,
                reward=reward,
                score=score,
                finish_reason=c.finish_reason,
                policy_version=c.policy_version,
                worker_id=c.worker_id,
                loss_mask=c.loss_mask,
                token_versions=c.token_versions,
                teacher_logprobs=teacher_logprobs,
            )
            if c.HasField("routed_experts"):  # routing replay: the engine's experts, for the trainer to replay
                sample.routed_experts.CopyFrom(c.routed_experts)
            sample.MergeFrom(shared)
            samples.append(sample)
        return samples

    def _batch_message(self, build: _Build, kept: list[ScoredGroup], seconds: float) -> controller_pb2.Batch:
        samples = [sample for gi, g in enumerate(kept) for sample in self._group_samples(gi, g)]
        generated = sum(len(g.rewards) for g in build.all_groups)  # every fresh sample, per-group sums below
        versions = [s.policy_version for s in samples]
        filler = build.filler
        stats = controller_pb2.BatchStats(
            groups_kept=len(kept),
            groups_filtered=filler.dropped_count,
            gen_batches=filler.gen_batches,
            rollout_version_min=min(versions),
            rollout_version_max=max(versions),
            generation_seconds=seconds,
            reward_mean=sum(sum(g.rewards) for g in build.all_groups) / generated,
            score_mean=sum(sum(g.scores) for g in build.all_groups) / generated,
            samples_generated=generated,
            response_len_mean=sum(g.response_tokens for g in build.all_groups) / generated,
            groups_stale=build.stale,
            groups_failed=build.failed,
            samples_aborted=build.aborted,
            prompts_too_long=build.too_long,
            prompts_truncated=build.truncated,
        )
        fill_episode_stats(stats, build.episodes)
        stats.reward_means.update(reward_means(build.all_groups))
        for name, client in self.scorer.clients.items():  # the served rewards' and the teacher's calls
            stats.scorer_metrics.update({f"{name}/{k}": v for k, v in client.step_metrics().items()})
        target = filler.target_groups if build.streamed else None
        return controller_pb2.Batch(
            batch_id=f"{build.step}-{uuid.uuid4().hex[:8]}",
            step=build.step,
            samples=samples,
            stats=stats,
            temperature=self.params.temperature,
            minibatch_groups=minibatch_groups(len(kept), self.cfg.trainer.mini_batches, target=target),
            prompts=[
                controller_pb2.PromptText(group=gi, text=g.record.text, answer=g.record.answer)
                for gi, g in enumerate(kept[: self.cfg.samples.prompts if self.cfg.samples else 0])
            ],  # what the trainer writes to samples.jsonl shows the user's prompt, not the rendered one alone
        )

    # -- trainer-facing ------------------------------------------------------------------------
    def _wait_for(self, step: int, timeout_s: float, ready: Callable[[], bool]) -> None:
        """Wait (holding ``self._cond``) until ``ready()``; the errors a trainer pulling ``step`` must hear."""
        deadline = time.monotonic() + timeout_s
        if step > self._next_step and not self._batches:
            self._next_step = step  # a trainer resumed ahead of this controller's state
            self._cond.notify_all()
        while not ready():
            if self.state == "failed":
                raise FailedPrecondition(self.error)
            if step <= self.progress.trainer_step:
                raise FailedPrecondition(f"step: {step} was already trained (last step {self.progress.trainer_step})")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if self.state == "paused":
                    raise Unavailable(f"{PAUSED_DETAIL}: no batch for step {step} until Resume; retry")
                raise Unavailable(f"{NOT_READY_DETAIL} {step} within {timeout_s:.0f}s; retry")
            self._cond.wait(min(remaining, 1.0))

    def _evals_before(self, step: int, timeout_s: float) -> float:
        """With ``_evals_first``, wait (at most half of ``timeout_s``) until no eval of a version before ``step``
        is queued or running, so that the trainer does not train step ``step`` on the cores an eval decodes on;
        the time left of ``timeout_s``."""
        if not self._evals_first:
            return timeout_s
        began = time.monotonic()
        self.evaluator.hold(step, timeout_s / 2)
        return max(0.0, timeout_s - (time.monotonic() - began))

    def pull_batch(self, step: int, timeout_s: float) -> controller_pb2.Batch:
        timeout_s = self._evals_before(step, timeout_s)
        with self._cond:
            self._wait_for(step, timeout_s, lambda: step in self._batches)
            batch = self._batches[step]
        self.ledger.mark(sorted({s.prompt_id for s in batch.samples}), QUEUED, step=step)
        return batch

    def stream_batch(self, step: int, timeout_s: float) -> Iterator[controller_pb2.BatchPart]:
        """Step ``step``'s batch as parts (see StreamBatch): its kept groups as they are kept when it is being
        built streamed, else all at once once it is built; then the batch without samples."""
        timeout_s = self._evals_before(step, timeout_s)
        with self._cond:
            self._wait_for(step, timeout_s, lambda: step in self._batches or step in self._streams)
            streamed = step not in self._batches
        temperature, sent = self.params.temperature, 0
        while True:
            with self._cond:
                while step not in self._batches and len(self._streams.get(step, ())) <= sent:
                    if self.state == "failed":
                        raise FailedPrecondition(self.error)
                    if step not in self._streams:
                        raise Unavailable(f"the batch of step {step} was abandoned mid-stream; pull the step again")
                    self._cond.wait(1.0)
                batch = self._batches.get(step)
                fresh = list((batch.samples if batch is not None else self._streams[step])[sent:])
            if fresh:
                yield controller_pb2.BatchPart(samples=fresh, streamed=streamed, temperature=temperature)
                sent += len(fresh)
            if batch is not None:
                break
        self.ledger.mark(sorted({s.prompt_id for s in batch.samples}), QUEUED, step=step)
        header = controller_pb2.Batch()
        header.CopyFrom(batch)
        del header.samples[:]
        yield controller_pb2.BatchPart(batch=header, streamed=streamed, temperature=temperature)

    def report_step(self, request: controller_pb2.ReportStepRequest) -> None:
        """The trainer trained ``request.batch_id`` as step ``request.step``. Crash-safe and idempotent: state.json
        records the report first (the commit point; a restart settles the rest, ``_load_batches``), and a report
        repeated because its answer was lost (a controller killed after saving it) is answered again."""
        with self._cond:
            batch = self._batches.get(request.step)
            if batch is None and (request.step, request.batch_id) == (
                self.progress.trainer_step,
                self.progress.last_batch_id,
            ):
                log.info("step %d: its report was recorded before a restart; answered again", request.step)
                return
            if batch is None or batch.batch_id != request.batch_id:
                raise NotFound(f"batch_id: {request.batch_id!r} is not the pending batch of step {request.step}")
            del self._batches[request.step]
            self.progress.trainer_step = request.step
            self.progress.last_batch_id = request.batch_id
            self.progress.policy_version = request.policy_version
            self.progress.last_sync_seconds = request.sync_seconds
            self.progress.last_sync_unix = time.time()
            self._set_exact(request.synced_worker_ids, request.policy_version)
            finished = request.step >= self.cfg.trainer.steps
            if finished:
                self.state = "finished"
            self._sync_ledger()  # write-ahead: the step's events are durable before the cursor that passes them
            self._save_progress()
            self._settle_reported(batch)
            self._cond.notify_all()
        if finished:  # a finished run is never paused: clients keep being served
            self.registry.set_paused(False)
        self.registry.set_versions(list(request.synced_worker_ids), request.policy_version)
        if self.evaluator is not None:
            self.evaluator.request(request.policy_version)
        self.pace.record(request.step_seconds, batch.stats.samples_generated, batch.stats.reward_mean)
        self.step_metrics = dict(request.metrics)
        self.syncs.record(
            controller_pb2.WeightSyncRecord(
                policy_version=request.policy_version,
                reason="step",
                seconds=request.sync_seconds,
                synced_worker_ids=request.synced_worker_ids,
            )
        )

    def rewind(self, request: controller_pb2.RewindRequest) -> int:
        """Roll the run back to a trainer checkpoint: undo later batches, ledger entries and draws."""
        if request.cursor < 0 or request.cursor > self.progress.cursor:
            raise InvalidArgument("cursor", f"{request.cursor} is outside [0, {self.progress.cursor}]")
        if request.step > self.progress.trainer_step:  # the trainer checkpoints a step only after reporting it
            raise InvalidArgument(
                "step", f"{request.step} is past the last step the trainer reported ({self.progress.trainer_step})"
            )
        with self._cond:
            for step in list(self._batches):
                (self._batch_dir / f"step_{step}.pb").unlink(missing_ok=True)
            self._batches.clear()
            self._epoch += 1
            undone = [self.dataset.record(d).prompt_id for d in range(request.cursor, self.progress.cursor)]
            count = self.ledger.rewind(undone, f"rolled back to checkpoint step {request.step}")
            self._streams.clear()
            self.progress.cursor = request.cursor
            self.progress.trainer_step = self.progress.policy_version = request.step
            self.progress.last_batch_id = ""  # a report of a later step is void with it
            self._set_exact(request.synced_worker_ids, request.step)
            self._next_step = request.step + 1
            finished = request.step >= self.cfg.trainer.steps
            self.state = "finished" if finished else "paused" if self.state == "paused" else "running"
            self.error = ""
            self._sync_ledger()  # the rewound events are durable before the cursor moves back
            self._save_progress()
            self._cond.notify_all()
        if finished:  # nothing can Resume a finished run: client prompts must not wait for it
            self.registry.set_paused(False)
        self.registry.set_versions(list(request.synced_worker_ids), request.step, exact=True)
        if self.evaluator is not None:
            self.evaluator.rewind(request.step)
        log.warning("rewound to step %d (cursor %d): %d prompts undone", request.step, request.cursor, count)
        return count

    def _set_exact(self, worker_ids, version: int) -> None:
        """Workers whose load of ``version`` was verified (call with ``self._cond`` held; saved by the caller)."""
        self.progress.exact_workers = sorted(worker_ids) if self.cfg.weight_sync.verify != "off" else []
        self.progress.exact_version = version

    def sync_plan(self, version: int = 0, hold_s: float = 20.0) -> controller_pb2.WeightSyncPlan:
        """The plan of an update to ``version``; held while an eval of an older version runs (at most ``hold_s``,
        then UNAVAILABLE naming it: the trainer retries)."""
        if self.evaluator is not None and (running := self.evaluator.hold(version, hold_s)) is not None:
            raise Unavailable(f"the eval of policy version {running} is running: the update to {version} waits")
        request_id, force = self.syncs.pending()
        return controller_pb2.WeightSyncPlan(
            workers=[
                controller_pb2.WorkerEndpoint(worker_id=w.worker_id, address=w.address, policy_version=w.policy_version)
                for w in sorted(self.registry.active(), key=lambda w: w.worker_id)
            ],
            sync_request_id=request_id,
            force=force,
        )

    def report_weight_sync(self, request: controller_pb2.ReportWeightSyncRequest) -> None:
        """An update outside a step (the trainer's first publish, operator request, joiners): versions and
        history. The first publish ("initial") also names the workers a streamed step 1 may use, and lets batch
        production begin (``_starting_weights_in``)."""
        self.registry.set_versions(list(request.synced_worker_ids), request.policy_version)
        if request.reason == "initial":
            with self._cond:
                self._set_exact(request.synced_worker_ids, request.policy_version)
                self._save_progress()
                self._cond.notify_all()
            if self.evaluator is not None:
                self.evaluator.request(request.policy_version)
        self.syncs.record(
            controller_pb2.WeightSyncRecord(
                policy_version=request.policy_version,
                reason=request.reason or "operator",
                seconds=request.seconds,
                synced_worker_ids=request.synced_worker_ids,
                failed=request.failed,
                sync_request_id=request.sync_request_id,
            )
        )

    # -- operators -----------------------------------------------------------------------------
    @property
    def batches_ready(self) -> int:
        """Queue depth: batches produced and not yet reported trained."""
        with self._cond:
            return len(self._batches)

    def status(self) -> controller_pb2.StatusResponse:
        counts = self.ledger.counts()
        workers = self.registry.snapshot()
        status = controller_pb2.StatusResponse(
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
                for w in workers
            ],
            ledger=controller_pb2.LedgerCounts(
                dispatched=len(self.ledger),
                trained=counts.get(TRAINED, 0),
                filtered=counts.get(FILTERED, 0),
                failed=counts.get(FAILED, 0),
                pending=counts.get(PENDING, 0) + counts.get(QUEUED, 0),
                torn_tails=self.ledger.torn_tails,
                failed_by_reason=self.ledger.reason_kinds(FAILED),
            ),
            last_sync_seconds=self.progress.last_sync_seconds,
            last_sync_unix=self.progress.last_sync_unix,
            error=self.error,
            dataset_cursor=self.progress.cursor,
            desired_rollout_replicas=self.progress.desired_rollout_replicas,
            drained_workers=sorted(self.drained - {w.worker_id for w in workers}),
            step_metrics=self.step_metrics,
            desired_scorer_replicas=self.progress.desired_scorer_replicas,
        )
        self.pace.fill(status, self.cfg.trainer.steps)
        if self.evaluator is not None:
            status.evals.extend(self.evaluator.latest())
        return status

    def pause(self, reason: str) -> controller_pb2.PauseRunResponse:
        """Stop batch production and dispatch; forward Pause to every worker."""
        with self._cond:
            if self.state not in ("running", "paused"):
                raise FailedPrecondition(f"state: the run is {self.state}; only a running run can be paused")
            self.state = "paused"
            self._cond.notify_all()
        self.registry.set_paused(True)
        log.warning("run paused by an operator: %s", reason or "no reason given")
        acked, errors = fan_out(self.registry.snapshot(), "Pause", rollout_pb2.PauseRequest(reason=reason), 10.0)
        return controller_pb2.PauseRunResponse(state="paused", workers=sorted(acked), worker_errors=errors)

    def resume(self) -> controller_pb2.ResumeRunResponse:
        with self._cond:
            if self.state not in ("running", "paused"):
                raise FailedPrecondition(f"state: the run is {self.state}; it cannot be resumed")
            self.state = "running"
            self._cond.notify_all()
        self.registry.set_paused(False)
        log.warning("run resumed by an operator")
        acked, errors = fan_out(self.registry.snapshot(), "Resume", rollout_pb2.ResumeRequest(), 10.0)
        return controller_pb2.ResumeRunResponse(state="running", workers=sorted(acked), worker_errors=errors)

    def drain(self, worker_id: str) -> controller_pb2.DrainWorkerResponse:
        """No new Generate calls for this worker; its in-flight calls finish."""
        if not self.registry.set_state(worker_id, DRAINING):
            raise NotFound(f"worker_id: no registered worker {worker_id!r}")
        self.drained.add(worker_id)
        handle = self.registry.get(worker_id)
        log.warning("worker %s draining (operator)", worker_id)
        return controller_pb2.DrainWorkerResponse(
            worker_id=worker_id, state=DRAINING, in_flight=handle.in_flight if handle else 0
        )

    def scale(self, replicas: int) -> controller_pb2.ScaleRolloutResponse:
        """Record the desired rollout replica count (persisted); launchers actuate it."""
        if replicas < 1:
            raise InvalidArgument("replicas", f"must be >= 1, got {replicas}")
        with self._cond:
            previous = self.progress.desired_rollout_replicas
            self.progress.desired_rollout_replicas = replicas
            self._save_progress()
        log.warning("desired rollout replicas: %d -> %d", previous, replicas)
        return controller_pb2.ScaleRolloutResponse(
            previous=previous, replicas=replicas, registered=len(self.registry.snapshot())
        )

    def _served(self, name: str) -> list:
        """The ScorerClients of served reward ``name`` (training's and the evals'); NotFound naming it when none."""
        owners = [self.scorer, *([self.evaluator.scoring.scorer] if self.evaluator is not None else [])]
        clients = [owner.clients[name] for owner in owners if name in owner.clients]
        if not clients:
            raise NotFound(f"name: {name!r} is no scorer this run calls ({', '.join(self.scorer.clients)})")
        return clients

    def scale_scorer(self, name: str, replicas: int) -> controller_pb2.ScaleScorerResponse:
        """Record the desired server count of scorer ``name`` (persisted); ``relayrl up`` actuates it."""
        clients = self._served(name)
        if replicas < 1:
            raise InvalidArgument("replicas", f"must be >= 1, got {replicas}")
        with self._cond:
            previous = self.progress.desired_scorer_replicas.get(name, 0)
            self.progress.desired_scorer_replicas[name] = replicas
            self._save_progress()
        log.warning("desired servers of scorer %s: %d -> %d", name, previous, replicas)
        return controller_pb2.ScaleScorerResponse(previous=previous, replicas=replicas, servers=len(clients[0].servers))

    def register_scorer(self, name: str, address: str, leaving: bool) -> controller_pb2.RegisterScorerResponse:
        """Add (or, ``leaving``, remove) ``address`` to the servers scorer ``name``'s calls go to."""
        clients = self._served(name)
        known = address in clients[0].servers  # a member joins again every few seconds: logged when it changes
        counts = [c.remove_server(address) if leaving else c.add_server(address) for c in clients]
        if known == leaving:
            log.info("scorer %s server %s %s: %d servers", name, address, "left" if leaving else "joined", counts[0])
        return controller_pb2.RegisterScorerResponse(servers=counts[0])

    def request_sync(self, force: bool) -> controller_pb2.SyncWeightsResponse:
        request_id = self.syncs.request(force)
        log.info("weight sync request %d (force=%s)", request_id, force)
        version = self.progress.policy_version
        return controller_pb2.SyncWeightsResponse(sync_request_id=request_id, policy_version=version)

    def weights_status(self) -> controller_pb2.WeightsStatusResponse:
        """Each worker's weights as it reports them (Stats, asked now) and the recent updates."""
        workers = sorted(self.registry.snapshot(), key=lambda w: w.worker_id)
        stats, errors = fan_out(workers, "Stats", rollout_pb2.StatsRequest(), timeout_s=5.0)
        entries = []
        for w in workers:
            entry = controller_pb2.WorkerWeights(
                worker_id=w.worker_id, address=w.address, state=w.state, policy_version=w.policy_version
            )
            if w.worker_id in stats:
                s = stats[w.worker_id]
                entry.policy_version = s.policy_version
                entry.last_update_seconds = s.last_update_seconds
                entry.weight_sync_group = s.weight_sync_group
                entry.generated_tokens = s.generated_tokens
                entry.tokens_per_second = s.tokens_per_second
            else:
                entry.error = errors.get(w.worker_id, "no answer")
            entries.append(entry)
        pending, _ = self.syncs.pending()
        return controller_pb2.WeightsStatusResponse(
            policy_version=self.progress.policy_version,
            workers=entries,
            recent_syncs=self.syncs.history(),
            sync_request_pending=pending,
            sync_request_handled=self.syncs.handled,
        )
