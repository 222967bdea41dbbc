"""The controller's episode engine: GRPO groups of agentic episodes, run on one asyncio loop in its own thread.

``EpisodeRunner.run(records, ...)`` is the agentic counterpart of ``Dispatcher.run``: for each prompt record it
runs ``rollout.n`` episodes of the record's task with one environment seed (a group), all at once: turns go to
the rollout workers (relayrl/episodes/turns.py), environment calls to the environment servers
(relayrl/episodes/envpool.py, ``environment.max_sessions`` in flight on each), and while one episode waits for
its environment every other episode's rows keep decoding. It blocks the calling (batch production) thread until
every group is complete or failed.

Why here, in the controller: the controller owns the tokenizer and every token id of the training path, so the
chat template is rendered once, by one process, and the sequence a worker continues is the one that is trained.
A rollout worker only ever sees token ids (one turn's prompt), an environment only chat messages.

A group with a failed episode is failed whole (``failed[prompt_id]`` names the episode and why): its other
episodes' advantages would be computed against a missing member.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.client.workers import WorkerRegistry
from relayrl.config import RelayConfig
from relayrl.data.dataset import PromptRecord
from relayrl.episodes.envpool import EnvironmentPool
from relayrl.episodes.loop import Episode, EpisodeLimits, EpisodeLoop
from relayrl.episodes.turns import Route, TurnDispatcher

log = logging.getLogger(__name__)
SEED_BITS = 62


def episode_seed(run_seed: int, prompt_id: str, row: Mapping[str, Any]) -> int:
    """The environment seed of a prompt's group: the row's integer ``seed`` column when it has one, else a stable
    hash of the run seed and the prompt id (so a row drawn again in a later epoch gets a new episode)."""
    seed = row.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    digest = hashlib.sha256(f"{run_seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)


def task_of(row: Mapping[str, Any]) -> dict:
    """The dataset row as the environment's task: JSON-safe (values JSON cannot carry become text)."""
    return json.loads(json.dumps(dict(row), default=str))


@dataclass
class EpisodeResult:
    groups: dict[str, list[Episode]] = field(default_factory=dict)  # prompt id -> its n episodes, in order
    failed: dict[str, str] = field(default_factory=dict)  # prompt id -> reason
    episodes: dict[str, list[Episode]] = field(default_factory=dict)  # every group that ended, failed ones included
    aborted: int = 0  # turns a worker aborted (a weight update, a pause): generated again
    seconds: float = 0.0


class EpisodeRunner:
    """Runs groups of episodes for the controller (module docstring). ``row_of(prompt_id)``: the dataset row (the
    task); ``client_factory``: an environment client per server address (tests; default ``AsyncEnvironmentClient``)."""

    def __init__(
        self,
        cfg: RelayConfig,
        registry: WorkerRegistry,
        tokenizer,
        params,
        row_of: Callable[[str], Mapping[str, Any]],
        *,
        client_factory=None,
    ) -> None:
        env = cfg.environment
        if env is None:
            raise ValueError("environment: episodes need the environment section")
        self.cfg, self.registry, self.tokenizer, self.params, self.row_of = cfg, registry, tokenizer, params, row_of
        self.limits = EpisodeLimits(env.max_turns, env.max_total_tokens, cfg.rollout.max_tokens)
        self._client_factory = client_factory
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="episodes", daemon=True)
        self._thread.start()
        self._turns: TurnDispatcher | None = None
        self._pool: EnvironmentPool | None = None

    def _setup(self) -> None:
        """The dispatcher and the pool, created on the loop (their channels bind to it)."""
        if self._turns is None:
            ccfg = self.cfg.controller
            self._turns = TurnDispatcher(
                self.registry,
                self.params,
                generate_timeout_s=ccfg.generate_timeout_s,
                max_rows_per_call=self.cfg.rollout.max_batch_size,
            )
            env = self.cfg.environment
            self._pool = EnvironmentPool(
                env.servers,
                max_sessions=env.max_sessions,
                timeout_s=env.step_timeout_s,
                client_factory=self._client_factory,
            )

    def run(
        self,
        records: Sequence[PromptRecord],
        *,
        min_version: int = 0,
        on_group: Callable[[str, list[Episode]], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        only: frozenset[str] | None = None,
    ) -> EpisodeResult:
        """``rollout.n`` episodes per record; blocks until each group is complete or failed. ``on_group`` hears each
        complete group (from the episode thread) as it completes; ``only``: send turns to these workers alone."""
        result = EpisodeResult()
        future = asyncio.run_coroutine_threadsafe(self._run(records, min_version, only, on_group, result), self._loop)
        start = time.monotonic()
        while True:
            try:
                future.result(timeout=0.2)
                break
            except TimeoutError:
                if should_stop():
                    future.cancel()
                    with_reason = "stopped before generation finished"
                    for record in records:
                        if record.prompt_id not in result.groups:
                            result.failed.setdefault(record.prompt_id, with_reason)
                    break
        result.seconds = time.monotonic() - start
        return result

    async def _run(self, records, min_version: int, only, on_group, result: EpisodeResult) -> None:
        self._setup()
        self._turns.route = Route(min_version, only)
        aborted_before = self._turns.aborted
        loop = EpisodeLoop(self.tokenizer, self._turns.generate, self.limits)

        async def group(record: PromptRecord) -> None:
            row = self.row_of(record.prompt_id)
            seed, task = episode_seed(self.cfg.run.seed, record.prompt_id, row), task_of(row)
            prefix = f"{record.prompt_id}/{uuid.uuid4().hex[:8]}"
            episodes = await asyncio.gather(
                *(loop.run(self._pool, f"{prefix}/{i}", task, seed) for i in range(self.cfg.rollout.n))
            )
            result.episodes[record.prompt_id] = episodes
            failed = [(i, e) for i, e in enumerate(episodes) if e.failed]
            if failed:
                i, episode = failed[0]
                result.failed[record.prompt_id] = f"episode {i} of {len(episodes)} failed: {episode.reason}"
                return
            result.groups[record.prompt_id] = episodes
            if on_group is not None:
                on_group(record.prompt_id, episodes)

        tasks = [asyncio.ensure_future(group(r)) for r in records]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            result.aborted = self._turns.aborted - aborted_before

    def close(self) -> None:
        async def shutdown() -> None:
            if self._turns is not None:
                await self._turns.close()
            if self._pool is not None:
                await self._pool.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
