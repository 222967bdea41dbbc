"""Held-out evaluation in the controller: each eval scores one set (``eval.sets``) at exactly one policy version.

Between updates (docs/evaluation.md): once the trainer reports version v (a step, its first publish, a rewind) and
v is due (``due``), the sets are generated at v on the rollout workers, beside the training rollouts (each engine
batches both). The trainer's next weight update asks for its plan with a later version; ``hold`` keeps that answer
back until no eval of an older version is queued or running, so no update lands while an eval generates: every
token it sampled is checked to come from v (an eval that saw another version is void, logged, never recorded).
Training stalls only for the part of the eval's generation that outlasts the trainer's next step. An eval of v
also waits (``defer``) while the batch trained from v generates (step v + 1, not streamed): at K = 0 the workers
are idle while the trainer trains that batch, so the eval runs then instead of sharing the engines with the batch
and delaying it (the eval before training delayed step 1 by its own length). Not where the trainer waits for the
evals (``relayrl.cores.threads.evals_first``: ``relayrl up`` at K = 0 on shared cores): there the eval of v runs
beside that generation, and the trainer takes the batch once the eval is done (``Controller.pull_batch``).

Results: ``<state dir>/evals.jsonl`` (EvalResult as protobuf JSON), one line per set and version, what survives a
restart: an eval recorded there is not run again; one cut by a kill is not there and runs again whole while its
version is on the workers; a rewind to step c voids the results of versions after c. Every eval's generations go to
``<run dir>/eval_samples.jsonl``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from relayrl.client.workers import WorkerRegistry
from relayrl.config import RelayConfig
from relayrl.controller.dispatch import Dispatcher, PromptJob
from relayrl.controller.scoring import ScoredGroup, Scorer
from relayrl.data.dataset import PromptDataset, PromptRecord
from relayrl.data.readable import finish_name
from relayrl.episodes.runner import EpisodeRunner
from relayrl.rewards import RewardRaised
from relayrl.rewards.eval_metrics import (
    average,
    extractor,
    full_marks,
    function_metrics,
    prompt_metrics,
    reward_extractor,
)
from relayrl.runtime.files import atomic_write
from relayrl.v1 import common_pb2, controller_pb2
from relayrl.wire.sampling import SamplingParams

log = logging.getLogger(__name__)
DEFER_POLL_S = 0.05  # how late a deferred eval sees that the batch it waited for is built


@dataclass
class EvalSet:
    name: str
    records: list[PromptRecord]  # prompt ids "eval/<set>/<row>"
    rows: dict[str, dict[str, Any]]  # prompt id -> the dataset row (the reward's `row`, an episode's task)


def load_eval_sets(cfg: RelayConfig, tokenizer) -> list[EvalSet]:
    """Each set's first ``eval.max_prompts`` rows (in the set's order, or drawn with run.seed when it shuffles),
    rendered as the training prompts are."""
    sets = []
    for name, set_cfg in cfg.eval.sets.items():
        dataset = PromptDataset(set_cfg, tokenizer, seed=cfg.run.seed)
        drawn = dataset.records(0, min(len(dataset), cfg.eval.max_prompts))
        records = [dataclasses.replace(r, prompt_id=f"eval/{name}/{r.prompt_id.partition(':')[2]}") for r in drawn]
        rows = {r.prompt_id: dataset.row(d.prompt_id) for r, d in zip(records, drawn)}
        sets.append(EvalSet(name, records, rows))
    return sets


def completion_versions(completion: common_pb2.Completion) -> set[int]:
    """The policy versions that sampled a completion's tokens (an episode's observation tokens left out)."""
    if not completion.token_versions:
        return {completion.policy_version}
    mask = completion.loss_mask or b"\x01" * len(completion.token_versions)
    return {v for v, m in zip(completion.token_versions, mask) if m}


def eval_params(cfg: RelayConfig) -> SamplingParams:
    """The eval's own sampling (``eval``: n, temperature, top_p, length), stopping as the training rollouts do (stop
    tokens and strings, min_tokens, ignore_eos)."""
    ecfg = cfg.eval
    return dataclasses.replace(
        cfg.rollout.sampling(),
        n=ecfg.n,
        temperature=ecfg.temperature,
        top_p=ecfg.top_p,
        max_tokens=ecfg.max_tokens or cfg.rollout.max_tokens,
    )


class EvalScorer:
    """Scores generated groups of an eval set into its metrics and its readable samples."""

    def __init__(self, cfg: RelayConfig, tokenizer, rows: Callable[[str], dict[str, Any]]) -> None:
        self.cfg = cfg.eval
        self.max_tokens = eval_params(cfg).max_tokens
        self.scorer = Scorer(
            cfg.controller.reward, tokenizer, cfg.max_response_tokens, rows,
            stop=cfg.rollout.stop, include_stop=cfg.rollout.include_stop_str_in_output, scorers=cfg.scorers,
        )  # fmt: skip
        self.episodic = cfg.environment is not None
        self.by_function = bool(cfg.controller.reward.fns)  # each function's metrics beside the weighted score's
        name = self.cfg.answer_extractor or reward_extractor(cfg.controller.reward)
        self.extract = extractor(name) if "maj" in self.cfg.metrics and name else None
        threshold = self.cfg.pass_threshold
        self.threshold = full_marks(cfg.controller.reward, self.episodic) if threshold is None else threshold
        self.function_threshold = 1.0 if threshold is None else threshold

    def score(self, record: PromptRecord, generated: list) -> ScoredGroup:
        """RewardRaised / RewardShapeError from the reward function."""
        if self.episodic:
            return self.scorer.episode_group(record, generated)
        return self.scorer.group(record, generated)

    def result(
        self, name: str, version: int, groups: list[ScoredGroup], failed: int, seconds: float
    ) -> controller_pb2.EvalResult:
        per_prompt = []
        for group in groups:
            answers = None
            if self.extract is not None:
                answers = [self.extract(t) for t in self.scorer.decode_all(group.completions)]
            metrics = prompt_metrics(group.scores, self.cfg.metrics, self.cfg.k, self.threshold, answers)
            if self.by_function:  # each function's full marks are 1 (full_marks)
                metrics |= function_metrics(group.parts, self.cfg.metrics, self.cfg.k, self.function_threshold)
            per_prompt.append(metrics)
        metrics = average(per_prompt)
        completions = [c for g in groups for c in g.completions]
        if completions:
            metrics["response_len_mean"] = sum(len(c.token_ids) for c in completions) / len(completions)
            truncated = sum(c.finish_reason == common_pb2.FINISH_REASON_LENGTH for c in completions)
            metrics["truncated_frac"] = truncated / len(completions)
        return controller_pb2.EvalResult(
            name=name,
            policy_version=version,
            metrics=metrics,
            prompts=len(groups),
            prompts_failed=failed,
            seconds=seconds,
            unix_time=time.time(),
        )

    def samples(self, name: str, version: int, groups: list[ScoredGroup]) -> list[dict]:
        """One readable record per prompt: its text, and each sample's response (episodes: the turns), reward and
        finish reason."""
        rows = []
        for group in groups:
            texts = self.scorer.decode_all(group.completions)
            samples = []
            for i, (c, text, score) in enumerate(zip(group.completions, texts, group.scores)):
                sample = {
                    "response": text,
                    "reward": score,
                    "finish_reason": finish_name(c.finish_reason),
                    "versions": sorted(completion_versions(c)),  # the one version the eval measured
                }
                if group.episodes:
                    sample["turns"] = group.episodes[i].messages
                samples.append(sample)
            rows.append(
                {"kind": "eval", "eval": name, "step": version, "prompt_id": group.record.prompt_id,
                 "prompt": group.record.text, "answer": group.record.answer,
                 "rendered_prompt": self.scorer.tokenizer.decode(list(group.record.token_ids)), "samples": samples}
            )  # fmt: skip
        return rows


class Evaluator:
    """Runs the evals the controller asks for (``request``), one version at a time, on a thread of its own."""

    def __init__(
        self,
        cfg: RelayConfig,
        registry: WorkerRegistry,
        tokenizer,
        state_dir: Path,
        defer: Callable[[int], bool] = lambda version: False,
    ) -> None:
        """``defer(v)``: the eval of v waits while it is true (the batch trained from v generates)."""
        self.cfg = cfg
        self.defer = defer
        self.sets = load_eval_sets(cfg, tokenizer)
        rows = {pid: row for s in self.sets for pid, row in s.rows.items()}
        self.scoring = EvalScorer(cfg, tokenizer, rows.__getitem__)
        self.params = eval_params(cfg)
        ccfg = cfg.controller
        self.dispatcher = Dispatcher(
            registry,
            chunk_size=ccfg.dispatch_chunk,
            generate_timeout_s=ccfg.generate_timeout_s,
            max_threads=4 * len(self.sets) + 16,
            straggler_factor=ccfg.straggler_factor,
        )
        self.episodes = None
        if cfg.environment is not None:  # its own runner: eval.n episodes per task, eval sampling
            episode_cfg = copy.deepcopy(cfg)
            episode_cfg.rollout.n, episode_cfg.rollout.max_tokens = self.params.n, self.params.max_tokens
            self.episodes = EpisodeRunner(episode_cfg, registry, tokenizer, self.params, rows.__getitem__)
        self.path = state_dir / "evals.jsonl"
        self.samples_path = cfg.run_dir / "eval_samples.jsonl"
        self.results = [json_format.Parse(line, controller_pb2.EvalResult()) for line in self._lines()]
        self._queue: deque[int] = deque()
        self._running: int | None = None
        self._epoch = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="evaluator", daemon=True)

    def _lines(self) -> list[str]:
        return [line for line in self.path.read_text().splitlines() if line.strip()] if self.path.exists() else []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self.episodes is not None:
            self.episodes.close()

    def due(self, version: int) -> bool:
        return self.cfg.eval.evaluates(version, self.cfg.trainer.steps)

    def _done(self, version: int) -> set[str]:
        return {r.name for r in self.results if r.policy_version == version}

    def request(self, version: int) -> None:
        """Queue the eval of ``version`` (now on the workers) when it is due and not done, queued or running."""
        with self._cond:
            if not self.due(version) or self._done(version) >= {s.name for s in self.sets}:
                return
            if version == self._running or version in self._queue:
                return
            self._queue.append(version)
            self._cond.notify_all()

    def rewind(self, version: int) -> None:
        """The run went back to ``version``: evals of later versions are void (queued, running or recorded)."""
        with self._cond:
            self._epoch += 1
            self._queue = deque(v for v in self._queue if v <= version)
            kept = [r for r in self.results if r.policy_version <= version]
            if len(kept) != len(self.results):
                self.results = kept
                atomic_write(self.path, "".join(_line(r) for r in kept))
            self._cond.notify_all()
        self.request(version)

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (self._running is not None)

    def hold(self, version: int, timeout_s: float) -> int | None:
        """Wait until no eval of a version older than ``version`` is queued or running (an update to ``version``
        may land); None once so, else the version still being evaluated after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                older = [v for v in (self._running, *self._queue) if v is not None and v < version]
                if not older:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return min(older)
                self._cond.wait(remaining)

    def list(self, min_version: int = 0) -> list[controller_pb2.EvalResult]:
        with self._cond:
            found = [r for r in self.results if r.policy_version >= min_version]
        return sorted(found, key=lambda r: (r.policy_version, r.name))

    def latest(self) -> list[controller_pb2.EvalResult]:
        """The newest result of each set."""
        newest: dict[str, controller_pb2.EvalResult] = {}
        for result in self.list():
            newest[result.name] = result
        return list(newest.values())

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                if not self._queue:
                    self._cond.wait(0.5)
                    continue
                version, epoch = self._queue.popleft(), self._epoch
                self._running = version  # from here the update to a later version is held (``hold``)
            try:
                while self.defer(version) and not self._stop.is_set() and epoch == self._epoch:
                    time.sleep(DEFER_POLL_S)
                for eval_set in self.sets:
                    if eval_set.name not in self._done(version):
                        self._run(eval_set, version, epoch)
            except Exception:  # an eval never takes the controller down: logged, the run goes on
                log.exception("eval of version %d failed", version)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _run(self, eval_set: EvalSet, version: int, epoch: int) -> None:
        measured = self.measure(eval_set, version, lambda: self._stop.is_set() or epoch != self._epoch)
        if measured is None:
            return
        result, samples = measured
        with self._cond:
            if epoch != self._epoch:
                return
            with self.path.open("a") as f:
                f.write(_line(result))
            self.results.append(result)
        with self.samples_path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in samples)

    def measure(
        self, eval_set: EvalSet, version: int, void: Callable[[], bool] = lambda: False, *, label: int | None = None
    ) -> tuple[controller_pb2.EvalResult, list[dict]] | None:
        """Generate ``eval_set`` on the workers at ``version`` and score it: (the result, its readable samples), or
        None: ``void()`` turned true, or a token came from another version (logged). ``label``: the policy version
        the weights are (default ``version``), that the result, its samples and the log line carry: ``relayrl eval``
        serves a checkpoint of step N as its own worker's version 0."""
        label = version if label is None else label
        start = time.monotonic()
        generated = self._generate(eval_set.records, version, void)
        if void():
            return None
        seen = {v for group in generated.groups.values() for c in _completions(group) for v in completion_versions(c)}
        if seen - {version}:
            log.error("eval %s of version %d is void: it sampled versions %s", eval_set.name, version, sorted(seen))
            return None
        groups, failed = [], len(generated.failed)
        for record in eval_set.records:
            if record.prompt_id not in generated.groups:
                continue
            try:
                groups.append(self.scoring.score(record, generated.groups[record.prompt_id]))
            except (RewardRaised, ValueError) as err:
                log.warning("eval %s: prompt %s failed: %s", eval_set.name, record.prompt_id, err)
                failed += 1
        result = self.scoring.result(eval_set.name, label, groups, failed, time.monotonic() - start)
        log.info(
            "eval %s at version %d: %s (%d prompts, %d failed, %.1fs)", eval_set.name, label,
            ", ".join(f"{k} {v:.3f}" for k, v in sorted(result.metrics.items())), result.prompts, failed,
            result.seconds,
        )  # fmt: skip
        return result, self.scoring.samples(eval_set.name, label, groups)

    def _generate(self, records: list[PromptRecord], version: int, void: Callable[[], bool]):
        if self.episodes is not None:
            return self.episodes.run(records, min_version=version, should_stop=void)
        jobs = [PromptJob(r.prompt_id, r.token_ids) for r in records]
        return self.dispatcher.run(jobs, self.params, min_version=version, should_stop=void)


def _completions(group: list) -> list[common_pb2.Completion]:
    """A generated group's completions (an episode group: each episode as one)."""
    return [g.completion("", i) if hasattr(g, "completion") else g for i, g in enumerate(group)]


def _line(result: controller_pb2.EvalResult) -> str:
    """An evals.jsonl line: the result as protobuf JSON."""
    return json_format.MessageToJson(result, indent=None) + "\n"
