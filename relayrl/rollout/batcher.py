"""Continuous batching for in-process engines: every request's rows share the decode steps.

One scheduler thread owns the model. ``submit`` queues a request (its prompts x n rows) and returns a
``RequestHandle`` whose completions arrive as rows finish. Between two decode steps the loop

1. answers aborts: every unfinished row of a request whose ``should_abort`` turned true (or whose caller
   went away) leaves the batch and is emitted with finish_reason "abort";
2. admits waiting rows, oldest request first, up to ``max_rows`` running rows: their distinct prompts are
   prefilled once and join the running batch (``DecodeState.merge``); a prompt that shares its beginning
   with a sequence the prefix cache holds (``relayrl.rollout.prefix_cache``) prefills only the rest, on its KV,
   and so do prompts that join together and begin alike (a system prompt, a chat template's opening): their
   common beginning, at least ``min_shared_beginning`` tokens (``MIN_SHARED_BEGINNING`` by default), is prefilled
   once and stored there first;
3. samples one token for every running row (each with its request's temperature, top-p, stop tokens,
   ``min_tokens``, generator; rows sampled alike share one call, whatever their request) and emits the rows
   that finished, their KV stored in the prefix cache first;
4. feeds the survivors' tokens through one decode step.

So rows join and leave between steps and no request waits for another to finish. A seeded request draws
from one generator per row (seeded from the request's seed, prompt and sample index), so its samples do
not depend on what else shares the batch; unseeded rows draw from the engine's generator.

In-flight weight updates (``pause`` / ``resume``): ``pause`` parks the loop between two steps, with every
running row's tokens, KV cache and next logits kept, and returns once it is parked; the weights are then
changed under it, and ``resume(version, recompute)`` continues the same rows. ``recompute`` (AReaL) first
prefills every running row's prompt and tokens so far on the new weights (new KV, new next logits); without it
(PipelineRL) the rows keep their KV and the logits computed before the update. Every sampled token is stamped
with the version of the weights that computed the logits it was drawn from (``version``: 0 until the first
resume, as a worker's), so after a keep-KV resume a row's next token still carries the old version. The rows of
every request alive at a resume report these per-token versions (``EngineCompletion.token_versions``).

Routing replay (``routing``: a ``RoutingRecorder`` on the model's routers): after each prefill and decode step the
experts each row's tokens were routed to are appended to the row (a recompute resume replaces them with its
prefill's), and a finished row reports them (``EngineCompletion.routed_experts``). It needs every prompt prefilled
in full: no prefix cache.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from relayrl.algorithms.routing_replay import RoutingRecorder
from relayrl.rollout.engine import EngineCompletion, FinishReason
from relayrl.rollout.intra_op import start_intra_op_owner
from relayrl.rollout.prefix_cache import CachedPrefix, PrefixCache
from relayrl.runtime.sequences import shared_beginning
from relayrl.wire.sampling import SamplingParams

log = logging.getLogger(__name__)

# tokens: a shorter beginning common to the joining prompts is prefilled with each of them. Sharing costs a forward
# of its own and copies of the beginning's KV for every row; on a CPU, eight SmolLM2-135M prompts broke even near 30
# shared tokens (`relayrl bench prefix --system-words N --min-shared 16`)
MIN_SHARED_BEGINNING = 32


class DecodeState(Protocol):
    """A model's decoding state for a batch of rows (KV cache, masks, positions)."""

    def select(self, index: torch.Tensor) -> None: ...

    def merge(self, other: DecodeState) -> None: ...


class ModelRunner(Protocol):
    """What the batcher needs from a model: prefill new rows (from scratch, or on a cached prefix's KV), decode one
    token for running rows, sample, and hand out a row's KV for the prefix cache."""

    device: torch.device

    def prefill(self, prompts: Sequence[Sequence[int]], expand: torch.Tensor) -> tuple[torch.Tensor, DecodeState]:
        """Forward ``prompts`` once each; row i continues prompt ``expand[i]``. (logits [R, V], state)."""

    def prefill_cached(
        self, prefixes: Sequence[CachedPrefix], suffixes: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, DecodeState]:
        """Forward each ``suffixes[i]`` at the positions after ``prefixes[i]`` (attending to its KV, causal among its
        own tokens): the logits [B, V] and the rows' state, holding each prefix's KV and its suffix's."""

    def row_kv(self, state: DecodeState, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row ``row``'s keys and values at its last ``length`` real (not pad) columns, per layer
        [kv_heads, length, head_dim]."""

    def decode(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row [B]; returns the next logits [B, V]."""

    def sample(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        generators: Sequence[torch.Generator],
        banned: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row and its logprob; one generator for all rows, or one per row."""


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one row of a seeded request: a fixed mix of (seed, prompt, sample) in [0, 2**63)."""
    return (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB) % (
        1 << 63
    )


@dataclass(eq=False)
class _Row:
    request: _Request
    prompt_index: int
    sample_index: int
    generator: torch.Generator | None  # seeded requests: this row's own
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the version that sampled each token
    logits_version: int = 0  # the version of the weights that computed the row's next logits
    kv_epoch: int = -1  # the prefix cache's epoch when the row's KV was computed (-1: none, never stored)
    prefix: tuple[int, ...] | None = None  # the cached prefix the row was prefilled on (demoted when it is stored)
    routing: list[torch.Tensor] = field(default_factory=list)  # routing replay: [positions, layers, k] per forward

    def finish(self, reason: FinishReason) -> None:
        versions = self.versions if self.request.updated else None
        routed = torch.cat(self.routing) if self.routing else None
        self.request.emit(
            EngineCompletion(
                self.prompt_index, self.sample_index, self.token_ids, self.logprobs, reason, versions, routed
            )
        )


class _Request:
    """One ``generate`` call: its rows, its sampling parameters and the queue its completions go to."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_ids: frozenset[int],
        banned: torch.Tensor,
        should_abort: Callable[[], bool] | None,
        device: torch.device,
        stop_strings: Callable[[list[int]], bool] | None = None,
    ) -> None:
        self.prompts, self.params, self.stop_ids, self.banned = prompts, params, stop_ids, banned
        self.stop_strings = stop_strings
        self._should_abort = should_abort
        self.cancelled = False
        self.updated = False  # alive at an in-flight weight update: its rows report per-token versions
        self.out: queue.SimpleQueue[EngineCompletion | BaseException] = queue.SimpleQueue()
        self.unfinished = len(prompts) * params.n
        self.released = threading.Event()  # set once none of its rows is in the batch any more
        if self.unfinished == 0:
            self.released.set()
        banned_ids = tuple(banned.tolist())
        # rows of any request with equal keys are sampled together (ContinuousBatcher._sample)
        self._keys = {
            held_back: (params.temperature, params.top_p, params.seed is not None, banned_ids if held_back else None)
            for held_back in (False, True)
        }
        seeded = params.seed is not None
        self.waiting: deque[_Row] = deque(
            _Row(self, p, s, _seeded(device, row_seed(params.seed, p, s)) if seeded else None)
            for p in range(len(prompts))
            for s in range(params.n)
        )

    def sampling_key(self, held_back: bool) -> tuple:
        """(temperature, top_p, seeded, the banned ids while ``held_back`` under min_tokens, else None)."""
        return self._keys[held_back]

    def aborted(self) -> bool:
        return self.cancelled or (self._should_abort is not None and bool(self._should_abort()))

    def emit(self, completion: EngineCompletion) -> None:
        self.out.put(completion)
        self.unfinished -= 1
        if self.unfinished == 0:
            self.released.set()


def _seeded(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


class RequestHandle:
    """The caller's side of a request: iterate to receive its completions as they finish."""

    def __init__(self, request: _Request, batcher: ContinuousBatcher) -> None:
        self._request, self._batcher = request, batcher

    def __iter__(self) -> Iterator[EngineCompletion]:
        for batch in self.batches():
            yield from batch

    def batches(self) -> Iterator[list[EngineCompletion]]:
        """The completions in groups: each wait returns every completion finished by then (at least one)."""
        request, received = self._request, 0
        total = len(request.prompts) * request.params.n
        try:
            while received < total:
                batch = [request.out.get()]
                while received + len(batch) < total:
                    try:
                        batch.append(request.out.get_nowait())
                    except queue.Empty:
                        break
                for item in batch:
                    if isinstance(item, BaseException):
                        raise item
                received += len(batch)
                yield batch
        finally:
            if received < total:  # the caller stopped listening: its rows leave the batch
                request.cancelled = True
                self._batcher.wake()
                request.released.wait()


class ContinuousBatcher:
    """The scheduler described in the module docstring, around one ``ModelRunner``."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_rows: int,
        generator: torch.Generator,
        threads: int | None = None,
        prefix_cache: PrefixCache | None = None,
        routing: RoutingRecorder | None = None,
        min_shared_beginning: int = MIN_SHARED_BEGINNING,
    ) -> None:
        """``threads``: the scheduler thread's torch intra-op threads, every other thread of the process then
        running its torch ops on one (``relayrl.rollout.intra_op``); None leaves torch's counts alone.
        ``prefix_cache``: where finished rows' KV is kept and joining prompts find their prefix's (None: off).
        ``routing``: records each row's routed experts (module docstring; refused with a prefix cache).
        ``min_shared_beginning``: the fewest tokens a beginning common to joining prompts is shared from."""
        self.runner, self.max_rows, self.generator, self.threads = runner, max_rows, generator, threads
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        if routing is not None and self.prefix_cache is not None:
            raise ValueError("routing replay needs every prompt prefilled in full: turn the prefix cache off")
        self.routing = routing
        self.min_shared_beginning = min_shared_beginning
        self.prefill_tokens = 0  # prompt tokens forwarded by prefills (observability: the prefix cache's savings)
        self.reused_tokens = 0  # prompt tokens whose KV came from the prefix cache instead
        self._cond = threading.Condition()
        self._requests: deque[_Request] = deque()  # admitted or waiting, oldest first
        self._closed = False
        self._thread: threading.Thread | None = None
        self.peak_rows = 0  # most rows ever decoded together (observability, tests)
        self.peak_requests = 0  # most requests ever in one decode step
        self.version = 0  # of the weights: stamped on every sampled token (module docstring)
        self._pausing = False  # pause() asked the loop to park
        self._parked = False  # the loop is parked between two steps
        self._recompute = False  # the resume asked for the running rows to be prefilled again
        self.recomputed_rows = 0  # rows prefilled again by recompute resumes (observability, tests)

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop_ids: frozenset[int],
        banned: torch.Tensor,
        should_abort: Callable[[], bool] | None = None,
        stop_strings: Callable[[list[int]], bool] | None = None,
    ) -> RequestHandle:
        """Queue a request; ``stop_ids`` end a row, and so does ``stop_strings(token_ids)`` turning true (its stop
        strings, ``SamplingParams.stop``); ``banned`` ids are masked while a row is under min_tokens."""
        request = _Request(prompts, params, stop_ids, banned, should_abort, self.runner.device, stop_strings)
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if request.unfinished:
                self._requests.append(request)
            if self._thread is None:
                self._thread = self._start_scheduler()
            self._cond.notify_all()
        return RequestHandle(request, self)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def pause(self) -> None:
        """Park the loop between two steps, rows and their state kept, and return once it is parked (at once when
        no loop runs). Requests submitted meanwhile wait; ``resume`` continues."""
        with self._cond:
            self._pausing = True
            self._cond.notify_all()
            while self._thread is not None and self._thread.is_alive() and not self._parked and not self._closed:
                self._cond.wait()

    def resume(self, version: int, *, recompute: bool) -> None:
        """Continue after ``pause`` on weights of ``version``; ``recompute``: prefill the running rows again first."""
        with self._cond:
            for request in self._requests:
                request.updated = True
            self.version, self._recompute, self._pausing = version, recompute, False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the scheduler thread ----------------------------------------------------------------------
    def _start_scheduler(self) -> threading.Thread:
        if self.threads is not None:
            return start_intra_op_owner(self._loop, self.threads, name="continuous-batching")
        thread = threading.Thread(target=self._loop, name="continuous-batching", daemon=True)
        thread.start()
        return thread

    def _loop(self) -> None:
        rows: list[_Row] = []
        logits: torch.Tensor | None = None
        state: DecodeState | None = None
        while True:
            with self._cond:
                while not (self._closed or self._pausing or rows or any(r.waiting for r in self._requests)):
                    self._drop_released()
                    self._cond.wait()
                recompute = self._park() if self._pausing else False
                if self._closed:
                    self._fail_all(rows, RuntimeError("the engine is closed"))
                    return
                requests = list(self._requests)
            try:
                with torch.inference_mode():
                    if recompute and rows:
                        logits, state = self._prefill_again(rows)
                    rows, logits, state = self._step(requests, rows, logits, state)
            except Exception as err:  # one failed step fails its requests, never the engine
                log.exception("generation step failed; failing the requests in the batch")
                self._fail_all(rows, err)
                rows, logits, state = [], None, None
            with self._cond:
                self._drop_released()

    def _park(self) -> bool:
        """Parked until ``resume`` (called with the lock held); returns whether it asked for a recompute."""
        self._parked = True
        self._cond.notify_all()
        while self._pausing and not self._closed:
            self._cond.wait()
        self._parked = False
        recompute, self._recompute = self._recompute, False
        return recompute

    def _prefill_again(self, rows: list[_Row]) -> tuple[torch.Tensor, DecodeState]:
        """Each running row's prompt and tokens so far, prefilled on the current weights (one row each)."""
        prompts = [[*row.request.prompts[row.prompt_index], *row.token_ids] for row in rows]
        epoch = self._epoch()
        logits, state = self.runner.prefill(prompts, torch.arange(len(rows), device=self.runner.device))
        if self.routing is not None:
            routed = self.routing.take(len(prompts))
            for row, prompt, routing in zip(rows, prompts, routed, strict=True):
                row.routing = [routing[routing.shape[0] - len(prompt) :]]
        self.prefill_tokens += sum(len(p) for p in prompts)
        for row in rows:
            row.logits_version, row.kv_epoch = self.version, epoch
        self.recomputed_rows += len(rows)
        return logits, state

    def _step(self, requests, rows, logits, state):
        """Aborts, admission, one sampled token per row, one decode step. Returns the new (rows, logits, state)."""
        aborted = {id(r) for r in requests if r.aborted()}
        if aborted:
            for request in requests:
                if id(request) in aborted:
                    while request.waiting:
                        request.waiting.popleft().finish("abort")
            keep = [i for i, row in enumerate(rows) if id(row.request) not in aborted]
            for row in rows:
                if id(row.request) in aborted:
                    row.finish("abort")
            rows, logits, state = self._select(rows, logits, state, keep)
        joining = self._admit(requests, len(rows))
        if joining:
            new_logits, new_state = self._prefill(joining)
            for row in joining:
                row.logits_version = self.version
            if state is None:
                rows, logits, state = joining, new_logits, new_state
            else:
                state.merge(new_state)
                rows, logits = rows + joining, torch.cat([logits, new_logits])
        if not rows:
            return [], None, None
        self.peak_rows = max(self.peak_rows, len(rows))
        self.peak_requests = max(self.peak_requests, len({id(r.request) for r in rows}))
        tokens, token_list = self._sample(rows, logits)
        keep = []
        for i, (row, token) in enumerate(zip(rows, token_list, strict=True)):
            if token in row.request.stop_ids or (row.request.stop_strings and row.request.stop_strings(row.token_ids)):
                reason = "stop"
            elif len(row.token_ids) == row.request.params.max_tokens:
                reason = "length"
            else:
                keep.append(i)
                continue
            self._keep_prefix(row, state, i)  # before the caller hears of it: its next turn finds it stored
            row.finish(reason)
        rows, _, state = self._select(rows, None, state, keep)
        if not rows:
            return [], None, None
        logits = self.runner.decode(state, tokens[keep] if len(keep) < len(tokens) else tokens)
        routed = self.routing.take(len(rows)) if self.routing is not None else None
        for i, row in enumerate(rows):
            row.logits_version = self.version
            if routed is not None:
                row.routing.append(routed[i])
        return rows, logits, state

    def _admit(self, requests: list[_Request], running: int) -> list[_Row]:
        joining: list[_Row] = []
        for request in requests:
            while request.waiting and running + len(joining) < self.max_rows:
                joining.append(request.waiting.popleft())
        return joining

    def _prefill(self, joining: list[_Row]) -> tuple[torch.Tensor, DecodeState]:
        """Each distinct prompt of the joining rows is forwarded once, whatever requests it comes in (the n samples
        of a prompt; an episode group's first turns, alike, each a request): in one batch those with no cached
        prefix, in another the others, only their tokens after the prefix, on the prefix's KV."""
        keys = [tuple(row.request.prompts[row.prompt_index]) for row in joining]
        slots: dict[tuple[int, ...], int] = {}
        prompts: list[tuple[int, ...]] = []
        for key in keys:
            if key not in slots:
                slots[key] = len(prompts)
                prompts.append(key)
        epoch = self._epoch()
        cache = self.prefix_cache
        hits = [cache.lookup(p) for p in prompts] if cache is not None else [None] * len(prompts)
        if cache is not None and self._share_beginning([p for p, hit in zip(prompts, hits) if hit is None], epoch):
            hits = [cache.lookup(p) for p in prompts]
        for row, key in zip(joining, keys, strict=True):
            hit = hits[slots[key]]
            row.kv_epoch, row.prefix = epoch, None if hit is None else hit.tokens
        plain = [i for i, hit in enumerate(hits) if hit is None]
        self.prefill_tokens += sum(len(prompts[i]) for i in plain)
        if len(plain) == len(prompts):
            expand = [slots[key] for key in keys]
            logits, state = self.runner.prefill(prompts, torch.tensor(expand, device=self.runner.device))
            if self.routing is not None:
                routed = self.routing.take(len(prompts))
                for row, key in zip(joining, keys, strict=True):
                    row.routing = [routed[slots[key], routed.shape[1] - len(key) :]]
            return logits, state
        cached = [i for i, hit in enumerate(hits) if hit is not None]
        suffixes = [prompts[i][len(hits[i].tokens) :] for i in cached]
        self.prefill_tokens += sum(map(len, suffixes))
        self.reused_tokens += sum(len(hits[i].tokens) for i in cached)
        logits, state = self.runner.prefill_cached([hits[i] for i in cached], suffixes)
        if plain:
            arange = torch.arange(len(plain), device=self.runner.device)
            plain_logits, plain_state = self.runner.prefill([prompts[i] for i in plain], arange)
            state.merge(plain_state)
            logits = torch.cat([logits, plain_logits])
        order = cached + plain
        at = {slot: position for position, slot in enumerate(order)}
        expand = torch.tensor([at[slots[key]] for key in keys], device=self.runner.device)
        state.select(expand)
        return logits[expand], state

    def _share_beginning(self, prompts: list[tuple[int, ...]], epoch: int) -> bool:
        """Prefill the beginning that ``prompts`` (found nowhere in the prefix cache) all share, each one's last token
        left out, once, and store its KV in the prefix cache under ``epoch``: each prompt then prefills only its
        tokens after it. Done for two or more prompts whose common beginning is at least ``min_shared_beginning``
        tokens and within the cache's budget; returns whether it was stored."""
        if len(prompts) < 2:
            return False
        length = min(shared_beginning(prompts), min(map(len, prompts)) - 1)
        if not self.min_shared_beginning <= length <= self.prefix_cache.budget:
            return False
        beginning = prompts[0][:length]
        _, state = self.runner.prefill([beginning], torch.zeros(1, dtype=torch.long, device=self.runner.device))
        self.prefill_tokens += length
        keys, values = self.runner.row_kv(state, 0, length)
        return self.prefix_cache.store(CachedPrefix(beginning, keys, values), epoch)

    def _epoch(self) -> int:
        """The prefix cache's epoch (0 without one): stamped on rows whose KV is computed now."""
        return self.prefix_cache.epoch if self.prefix_cache is not None else 0

    def _keep_prefix(self, row: _Row, state: DecodeState, index: int) -> None:
        """Store a finished row's KV in the prefix cache: its prompt and every sampled token but the last (never
        fed), when computed under the cache's current epoch and within its budget, for requests of one sample per
        prompt (``n`` = 1: how episode turns come; a GRPO group's n samples are never continued)."""
        cache = self.prefix_cache
        if cache is None or row.kv_epoch != cache.epoch or row.request.params.n != 1:
            return
        tokens = (*row.request.prompts[row.prompt_index], *row.token_ids[:-1])
        if len(tokens) > cache.budget:
            return
        keys, values = self.runner.row_kv(state, index, len(tokens))
        cache.store(CachedPrefix(tokens, keys, values), row.kv_epoch, extends=row.prefix)

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """One token per row (appended with its logprob); returns them as a tensor and a list.

        Rows whose sampling is the same (``_Request.sampling_key``) are sampled in one call whatever request
        they belong to: unseeded ones from the engine's generator, seeded ones each from its own.
        """
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):
            request = row.request
            groups.setdefault(request.sampling_key(len(row.token_ids) < request.params.min_tokens), []).append(i)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        logprobs = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
        for key, index in groups.items():
            request = rows[index[0]].request
            at = slice(None) if len(groups) == 1 else torch.tensor(index, device=logits.device)
            generators = [rows[i].generator for i in index] if request.params.seed is not None else [self.generator]
            banned = request.banned if key[-1] is not None else None
            tokens[at], logprobs[at] = self.runner.sample(logits[at], request.params, generators, banned)
        token_list = tokens.tolist()
        for row, token, logprob in zip(rows, token_list, logprobs.tolist(), strict=True):
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            row.versions.append(row.logits_version)
        return tokens, token_list

    def _select(self, rows, logits, state, keep: list[int]):
        """Keep rows ``keep`` (in order) of the rows, their logits (if given) and the decoding state."""
        if len(keep) == len(rows):
            return rows, logits, state
        if not keep:
            return [], None, None
        index = torch.tensor(keep, device=self.runner.device)
        state.select(index)
        return [rows[i] for i in keep], None if logits is None else logits[index], state

    def _drop_released(self) -> None:
        """Forget finished requests (called with the lock held)."""
        while self._requests and self._requests[0].released.is_set():
            self._requests.popleft()
        if any(r.released.is_set() for r in self._requests):
            self._requests = deque(r for r in self._requests if not r.released.is_set())

    def _fail_all(self, rows: list[_Row], err: BaseException) -> None:
        with self._cond:
            requests = list(self._requests)
        for request in requests:
            if not request.released.is_set():
                request.waiting.clear()
                request.out.put(err)
                request.unfinished = 0
                request.released.set()
        rows.clear()
