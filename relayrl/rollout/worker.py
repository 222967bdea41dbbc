"""A rollout worker's logic: one engine, versioned weights, admission control (no gRPC here).

Concurrent Generate calls are not serialized: they reach the engine together and share its decode
steps (continuous batching). Atomic versions: weights change only while no call is in flight, and a
call's version is fixed when it is admitted. ``pause`` mode: stop admitting calls, abort the in-flight
ones (their prompts come back as "abort" and the controller re-dispatches them), load, resume.
``shadow`` mode (in-process engines): receive into a second copy while the calls run, then hold new
calls back until the running ones have finished and swap the two copies. Either way every completion
is generated entirely by one version, the one stamped on it. A failed load leaves the worker "torn":
it refuses Generate and reports version -1 until a later update succeeds.

LoRA (``WeightManifest.kind``): a "base" manifest loads the frozen weights like a full one but leaves the version
(the adapter) as it is; an "adapter" manifest is received while calls run, into staging copies, verified, then
swapped in with no call in flight (``_update_adapter``): a transfer or load that fails leaves the previous adapter
and version serving.

In-flight updates (``rollout.partial`` recompute / keep_kv, engines with ``supports_in_flight_update``): the
calls in flight are neither aborted nor waited for. New calls wait; the engine freezes its rows
(``pause_in_flight``); the weights are loaded (pause mode) or, received meanwhile into the spare copy, swapped in
(shadow mode); the rows continue on the new weights (``resume_in_flight(version)``). A completion that lived
through an update carries the version of each token (``Completion.token_versions``) and, as its
``policy_version``, the oldest of them. A failed load aborts the frozen rows before they continue. (Full and
base updates; an adapter update aborts or waits for the calls as without it.)

In-process engines keep their weights in a ``WeightArena`` with the manifest's layout (adopted at
the first update, a bucket at a time), so a broadcast lands in place: in the live arena (pause) or
in the spare one (shadow), with no staging buffer and no copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from relayrl.algorithms.routing_replay import to_message
from relayrl.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from relayrl.rollout.engine import EngineCompletion, InferenceEngine
from relayrl.rollout.lora import adapted_modules
from relayrl.runtime import faults
from relayrl.v1 import common_pb2, rollout_pb2
from relayrl.weightsync.arena import WeightArena
from relayrl.weightsync.checksum import checksum_method, weights_checksum
from relayrl.weightsync.errors import WeightSyncError
from relayrl.weightsync.filesystem import latest_version, read_weights
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.weightsync.manifest import LayoutCache, UnknownLayout, WeightManifest
from relayrl.weightsync.packing import BufferPair
from relayrl.weightsync.receiver import receive_into, receive_weights
from relayrl.weightsync.stats import ReceiveStats
from relayrl.wire.sampling import GenerationLimits, SamplingParams, validate_request

log = logging.getLogger(__name__)
FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH}
TORN_VERSION = -1


def whole_groups(batches: Iterable[list[EngineCompletion]], n: int) -> Iterator[list[EngineCompletion]]:
    """``batches`` (an engine's ``generate_batches``) regrouped for ``GenerateRequest.whole_groups``: a prompt's
    completions are held until all ``n`` are done, then go with the other groups done in the same engine step.
    An aborted completion ends the call: it goes at once, with everything held (nothing is dropped)."""
    held: dict[int, list[EngineCompletion]] = {}
    try:
        for batch in batches:
            ready: list[EngineCompletion] = []
            for completion in batch:
                group = held.setdefault(completion.prompt_index, [])
                group.append(completion)
                if len(group) == n:
                    ready += held.pop(completion.prompt_index)
            if held and any(c.finish_reason == "abort" for c in batch):
                ready += [c for group in held.values() for c in group]
                held.clear()
            if ready:
                yield ready
        if held:
            yield [c for group in held.values() for c in group]
    finally:  # a caller that stops listening frees the engine's rows now, as without the regrouping
        if hasattr(batches, "close"):
            batches.close()


class TokenRate:
    """Generated tokens per second over a sliding window."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self.total = 0

    def add(self, tokens: int) -> None:
        now = time.monotonic()
        self._events.append((now, tokens))
        self.total += tokens
        while self._events and now - self._events[0][0] > self.window_s:
            self._events.popleft()

    def rate(self) -> float:
        if not self._events:
            return 0.0
        span = max(time.monotonic() - self._events[0][0], 1e-3)
        return sum(n for _, n in self._events) / span


def fault_injection(worker_id: str, version: int):
    """The ``rollout.load`` fault point (relayrl/runtime/faults.py): armed for ``<worker id>/<version>``, a
    progress callback that ends the worker as soon as the first chunk of that version has arrived. None otherwise."""
    if not faults.armed("rollout.load", f"{worker_id}/{version}"):
        return None

    def die(_received: object) -> None:
        log.error("fault point rollout.load: exiting in the middle of loading version %d", version)
        faults.crash("rollout.load")

    return die


class RolloutWorker:
    """Engine + version + admission control. Thread-safe; the servicer is a thin layer over it."""

    def __init__(
        self, engine: InferenceEngine, worker_id: str, *, mode: str, limits: GenerationLimits, partial: str = "off"
    ) -> None:
        if partial != "off" and not engine.supports_in_flight_update:
            raise ValueError(f"rollout.partial ({partial}): the {engine.name} engine cannot update weights in flight")
        self.engine = engine
        self.worker_id = worker_id
        self.mode = mode
        self.in_flight = partial != "off"  # weight updates leave the rows in flight running (module docstring)
        self.limits = limits
        self.version = 0
        self.state = "serving"
        self.group: WeightBroadcastGroup | None = None
        self.last_update_seconds = 0.0
        self.rate = TokenRate()
        self._cond = threading.Condition()
        self._active = 0
        self._updating = False
        self._update_lock = threading.Lock()
        self._paused = False
        self._abort = threading.Event()
        self._buffers = BufferPair("cpu")  # staging, for weights that cannot be received in place
        self._layouts = LayoutCache()
        self._checked_layout = ""  # id of the last layout found to match the engine's weights
        self._live: WeightArena | None = None  # the arena the engine's parameters view
        self._spare: WeightArena | None = None  # shadow mode: where the next update lands
        self.loaded: deque[rollout_pb2.LoadedVersion] = deque(maxlen=64)
        self._adapter_loads = 0  # suffix of adapter names: a name is never reused (engines key caches by it)
        # vllm / sglang: the engine's own GPU processes join the group and receive (docs/engines.md)
        self.engine_receives = bool(getattr(engine, "receives_weights_itself", False))
        if self.engine_receives and mode != "pause":
            raise ValueError(f"weight_sync.mode: the {engine.name} engine supports 'pause' only, got {mode!r}")

    @property
    def reported_version(self) -> int:
        return TORN_VERSION if self.state == "torn" else self.version

    # -- generation --------------------------------------------------------------------------------
    def _check_routing_size(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """With routing replay, a group's routed experts (n completions of the longest prompt at ``max_tokens``,
        travelling in one message) must fit a response message: RESOURCE_EXHAUSTED ``routed_experts`` otherwise."""
        per_token = self.engine.routed_bytes_per_token
        size = params.n * (max(map(len, prompts)) + params.max_tokens - 1) * per_token
        if size > self.limits.max_message_bytes:
            raise ResourceExhausted("routed_experts", self.limits.max_message_bytes, size)

    def generate(self, request: rollout_pb2.GenerateRequest, is_active) -> iter:
        prompts = [list(p.token_ids) for p in request.prompts]
        params = SamplingParams.from_proto(request.params)
        validate_request(
            prompts,
            params,
            vocab_size=self.engine.vocab_size,
            max_model_len=self.engine.max_model_len,
            limits=self.limits,
        )
        self._check_routing_size(prompts, params)
        with self._cond:
            if self._paused or self.state in ("draining", "torn"):
                raise Unavailable(f"worker {self.worker_id} is {self.state if not self._paused else 'paused'}")
            while self._updating:  # a load (pause) or a swap (shadow) is waiting for the calls in flight
                self._cond.wait()
            version = self.reported_version  # fixed for the call: weights change only while no call is in flight
            if version < request.min_policy_version:
                raise FailedPrecondition(
                    f"min_policy_version: worker has version {version} < {request.min_policy_version}"
                )
            self._active += 1
        try:  # no lock around the engine: concurrent calls share its decode steps (continuous batching)
            should_abort = lambda: self._abort.is_set() or not is_active()  # noqa: E731
            batches = self.engine.generate_batches(prompts, params, should_abort=should_abort)
            for batch in whole_groups(batches, params.n) if request.whole_groups else batches:
                self.rate.add(sum(len(c.token_ids) for c in batch))
                yield rollout_pb2.GenerateResponse(
                    completions=[
                        common_pb2.Completion(
                            prompt_id=request.prompts[c.prompt_index].prompt_id,
                            sample_index=c.sample_index,
                            token_ids=c.token_ids,
                            logprobs=c.logprobs,
                            finish_reason=FINISH.get(c.finish_reason, common_pb2.FINISH_REASON_ABORT),
                            policy_version=min(c.token_versions) if c.token_versions else version,
                            token_versions=c.token_versions or (),
                            worker_id=self.worker_id,
                            routed_experts=None if c.routed_experts is None else to_message(c.routed_experts),
                        )
                        for c in batch
                    ]
                )
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    # -- weights -----------------------------------------------------------------------------------
    def init_weight_sync(self, request: rollout_pb2.InitWeightSyncRequest) -> None:
        if not 1 <= request.rank < request.world_size:
            raise InvalidArgument("rank", f"{request.rank} is not in [1, {request.world_size})")
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.engine_receives:
            self._init_engine_weight_sync(request)
            return
        device = "cuda" if request.backend == "nccl" else "cpu"
        self.group = WeightBroadcastGroup(
            request.master_address,
            request.master_port,
            request.rank,
            request.world_size,
            group_name=request.group_name,
            backend=request.backend or "gloo",
            timeout_s=request.timeout_s or 60.0,
            device=device,
        )

    def _init_engine_weight_sync(self, request: rollout_pb2.InitWeightSyncRequest) -> None:
        """The engine's processes join as ranks request.rank .. + weight_sync_ranks - 1; the trainer assigns one
        rank per worker, so only single-rank engines can (tensor-parallel ones: the filesystem transport)."""
        from relayrl.rollout.external import GroupArgs

        if self.engine.weight_sync_ranks != 1:
            raise FailedPrecondition(
                f"rank: this {self.engine.name} engine spans {self.engine.weight_sync_ranks} group ranks "
                "(tensor/pipeline parallel) but the trainer assigns one per worker; use the filesystem transport"
            )
        self.group = self.engine.init_weight_sync(
            GroupArgs(
                master_address=request.master_address,
                master_port=request.master_port,
                rank_offset=request.rank,
                world_size=request.world_size,
                group_name=request.group_name,
                backend=request.backend or "gloo",
                timeout_s=request.timeout_s or 60.0,
            )
        )

    def _checksum(self, like: str = "") -> str:
        """weights_checksum of the loaded weights by the method of ``like``; an engine that receives them
        itself hashes what it loaded."""
        if self.engine_receives:
            return self.engine.loaded_checksum()
        return weights_checksum(self.engine.named_weights(), method=checksum_method(like))

    def update_weights(self, request: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        """One update at a time: a retry of a released update waits until the released one has unwound (its
        receive ends once its group is closed, by the release or by the retry's InitWeightSync)."""
        with self._update_lock:
            return self._update_weights(request)

    def _update_weights(self, request: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        manifest = self._checked_manifest(request.manifest)
        # the update receives on the group it names, never on a newer one: a released update that reaches its
        # receive after the retry's InitWeightSync would otherwise take the retry's bytes and leave it waiting
        group = self.group
        if manifest.transport == "broadcast" and (group is None or group.group_name != request.group_name):
            raise FailedPrecondition(f"group_name: {request.group_name!r} is not this worker's weight-sync group")
        start = time.perf_counter()
        if manifest.kind == "adapter":
            stats = self._update_adapter(manifest, group)
        elif self.mode == "shadow":
            stats = self._update_shadow(manifest, group)
        else:
            stats = self._update_paused(manifest, group)
        # stats.checksum: the fingerprint folded as the bytes landed, already compared with the sender's in band
        checksum = stats.checksum or ("" if manifest.verify == "off" else self._checksum(manifest.checksum))
        if manifest.checksum and checksum != manifest.checksum:
            self.state = "torn"
            raise FailedPrecondition(f"checksum: loaded weights {checksum[:12]} != manifest {manifest.checksum[:12]}")
        self.last_update_seconds = time.perf_counter() - start
        self.loaded.append(
            rollout_pb2.LoadedVersion(
                policy_version=self.version, checksum=checksum, load_seconds=self.last_update_seconds
            )
        )
        return rollout_pb2.UpdateWeightsResponse(
            policy_version=self.version,
            checksum=checksum,
            load_seconds=self.last_update_seconds,
            peak_extra_bytes=stats.peak_extra_bytes,
        )

    def release_update(self, group_name: str) -> None:
        """The caller of the update on ``group_name`` gave up on it (cancelled: the trainer saw another member fail):
        close that group, so that a receive waiting on it for bytes that will not come fails now rather than at the
        group's timeout. Groups of engines that receive weights themselves are theirs to end."""
        group = self.group
        if isinstance(group, WeightBroadcastGroup) and group.group_name == group_name:
            group.close()

    def _checked_manifest(self, msg: common_pb2.WeightManifest) -> WeightManifest:
        """The manifest, refused before anything is paused or loaded when it cannot apply to this engine
        (so a bad request never leaves the worker torn)."""
        try:
            manifest = self._layouts.resolve(msg)
        except UnknownLayout:
            raise FailedPrecondition(
                f"manifest.layout_id: {msg.layout_id[:12]} was never sent to this worker; send the full manifest"
            ) from None
        except ValueError as err:
            raise InvalidArgument("manifest", str(err)) from None
        if manifest.kind == "adapter" and not self.engine.supports_lora:
            raise FailedPrecondition(f"manifest.kind: the {self.engine.name} engine cannot load LoRA adapters")
        if manifest.kind == "adapter":
            try:
                adapted_modules([spec.name for spec in manifest.tensors])
            except ValueError as err:
                raise InvalidArgument("manifest.tensors", str(err)) from None
        if manifest.kind != "adapter" and manifest.layout_id != self._checked_layout:  # checked once per layout
            self._check_tensors(manifest)
            self._checked_layout = manifest.layout_id
        if manifest.transport == "filesystem":
            try:
                published = latest_version(manifest.path) if manifest.path else None
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise FailedPrecondition(f"manifest.path: cannot read its LATEST marker: {err}") from None
            if published != manifest.version:
                raise FailedPrecondition(f"manifest.path: publishes version {published}, not {manifest.version}")
        return manifest

    def _check_tensors(self, manifest: WeightManifest) -> None:
        """InvalidArgument unless every tensor of ``manifest`` is a weight of the engine, of its shape; for an
        in-process engine, also of its dtype, and every weight in it (the update replaces them all, in place)."""
        specs = self.engine.weight_specs()
        if not self.engine_receives:
            try:
                manifest.validate_against(specs)
            except ValueError as err:
                raise InvalidArgument("manifest.tensors", str(err)[:300]) from None
            return
        shapes = {name: shape for name, shape, _ in specs}
        for spec in manifest.tensors:
            if shapes.get(spec.name) != spec.shape:
                raise InvalidArgument("manifest.tensors", f"{spec.name[:200]}: no weight of that name and shape")

    def _receive(
        self, manifest: WeightManifest, group: WeightBroadcastGroup | None, target: WeightArena | None, load_fn=None
    ) -> ReceiveStats:
        """Bring ``manifest``'s bytes, from ``group`` (broadcast transport), into ``target`` (None: through
        ``load_fn``, default ``engine.load_weights``)."""
        die = fault_injection(self.worker_id, manifest.version)
        load_fn = target.load if target is not None else load_fn or self.engine.load_weights
        if die is not None:
            load_fn = _then(load_fn, die)
        try:
            if self.engine_receives:
                return self.engine.receive_update(manifest)
            if manifest.transport == "filesystem":
                return read_weights(manifest.path, manifest, load_fn)
            if target is not None and target.device.type == group.device.type:
                return receive_into(group, manifest, target, progress=die)
            return receive_weights(group, manifest, load_fn, buffers=self._buffers)
        except WeightSyncError:
            if group is not None:
                group.close()
                if self.group is group:
                    self.group = None
                self._forget_posted_memory()
            raise

    def _forget_posted_memory(self) -> None:
        """After a failed broadcast receive: receives the closed group posted may still land (gloo runs its
        operations out: relayrl.weightsync.group), into the arena or staging buffers they target. The next update
        receives into fresh ones (the live arena is adopted again from the parameters), so no late write ever
        reaches weights that serve."""
        self._live = self._spare = None
        self._buffers = BufferPair("cpu")

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.engine.named_weights())

    def _update_paused(self, manifest: WeightManifest, group: WeightBroadcastGroup | None) -> ReceiveStats:
        with self._held(abort=True, freeze=self.in_flight):
            try:
                self.state = "loading"
                if not self.engine_receives and (self._live is None or not self._live.fits(manifest)):
                    self._live = self._spare = None  # an old arena's bucket goes as soon as its tensors move out
                    self._live = WeightArena.adopt(manifest, self._params(), self._device())
                stats = self._receive(manifest, group, self._live)
                self.version = self.version if manifest.kind == "base" else manifest.version
                self.state = "serving"
                return stats
            except Exception:
                self.state = "torn"
                raise

    def _update_shadow(self, manifest: WeightManifest, group: WeightBroadcastGroup | None) -> ReceiveStats:
        """Receive into the spare arena (allocated when missing or of another layout), then swap it in:
        the live arena becomes the spare of the next update (steady state: two arenas, no allocation)."""
        if self._spare is None or not self._spare.fits(manifest):
            self._spare = WeightArena(manifest, self._device())
        stats = self._receive(manifest, group, self._spare)
        with self._held(abort=False, freeze=self.in_flight):  # re-point the parameters, O(1) per tensor
            self._spare.point(self._params())
            self._live, self._spare = self._spare, self._live
            self.version = self.version if manifest.kind == "base" else manifest.version
            if self.state == "torn":
                self.state = "serving"
        return stats

    def _update_adapter(self, manifest: WeightManifest, group: WeightBroadcastGroup | None) -> ReceiveStats:
        """An adapter update (module docstring). In-process engines: the tensors are received into copies while
        calls run (a WeightSyncError or a fingerprint mismatch raises here, nothing loaded), then loaded with no
        call running (``pause``: aborted; ``shadow``: finished; in-flight updates: frozen, then continued on the
        new adapter) under a name never used before; the engine's
        count of adapted modules must be the count sent. Engines that receive weights themselves load it in
        ``receive_update`` (pause)."""
        if self.engine_receives:
            with self._held(abort=True, freeze=self.in_flight):
                stats = self._receive(manifest, group, None)
                self.version = manifest.version
            return stats
        tensors: dict[str, torch.Tensor] = {}
        stats = self._receive(manifest, group, None, lambda views: tensors.update((n, t.clone()) for n, t in views))
        if manifest.checksum:  # checked out of band, before anything is loaded
            landed = weights_checksum(tensors.items(), method=checksum_method(manifest.checksum))
            if landed != manifest.checksum:
                raise FailedPrecondition(f"checksum: adapter {landed[:12]} landed, manifest {manifest.checksum[:12]}")
            stats = replace(stats, checksum=landed)
        sent = len(adapted_modules(tensors))
        self._adapter_loads += 1
        name = f"policy-v{manifest.version}.{self._adapter_loads}"
        with self._held(abort=self.mode == "pause", freeze=self.in_flight):
            try:
                loaded = self.engine.load_adapter(name, manifest.lora, tensors)
            except ValueError as err:
                raise FailedPrecondition(f"manifest.tensors: {err}; version {self.version} serves on") from None
            if loaded != sent:  # the engine serves something else than was sent: refuse calls until the next update
                self.state = "torn"
                raise FailedPrecondition(f"manifest.tensors: the engine adapted {loaded} modules, {sent} were sent")
            self.version = manifest.version
        return stats

    @contextmanager
    def _held(self, *, abort: bool, freeze: bool = False) -> Iterator[None]:
        """Inside, the weights may change: new calls wait, and those in flight are frozen by the engine (``freeze``:
        in-flight updates; they go on at ``self.version`` after, or end as aborts when the block raised), aborted
        (``abort``: their prompts come back for re-dispatch) or finish first."""
        with self._cond:
            self._updating = True
            if abort and not freeze:
                self._abort.set()
            while self._active and not freeze:
                self._cond.wait()
        if freeze:
            self.engine.pause_in_flight()
        try:
            yield
        except BaseException:
            self._abort.set()  # frozen rows must not go on with weights that failed to load
            raise
        finally:
            self.engine.weights_changed()  # e.g. the hf engine's prefix KV cache goes
            if freeze:
                self.engine.resume_in_flight(self.version)
            with self._cond:
                while self._abort.is_set() and self._active:  # aborted rows end before the abort is lifted
                    self._cond.wait()
                self._updating = False
                self._abort.clear()
                self._cond.notify_all()

    def _device(self) -> torch.device:
        return next(iter(self.engine.named_weights()))[1].device

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stats(self, with_checksum: bool) -> rollout_pb2.StatsResponse:
        return rollout_pb2.StatsResponse(
            worker_id=self.worker_id,
            engine=self.engine.name,
            state="paused" if self._paused else self.state,
            policy_version=self.reported_version,
            active_requests=self._active,
            generated_tokens=self.rate.total,
            tokens_per_second=self.rate.rate(),
            weights_checksum=self._checksum() if with_checksum else "",
            weight_sync_group=self.group.group_name if self.group else "",
            last_update_seconds=self.last_update_seconds,
            loaded=list(self.loaded),
        )


def _then(load_fn, after):
    """``load_fn`` followed by ``after(views)``."""

    def both(views):
        load_fn(views)
        after(views)

    return both
