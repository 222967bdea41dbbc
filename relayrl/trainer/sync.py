"""Trainer rank 0's side of weight sync: group membership, one manifest per update, packed buckets.

The step's weights are gathered into ``arena_for(specs)``: a ``WeightArena`` in the manifest's layout,
placed by ``arena_placement``: on gloo in host memory, sent as it is; on NCCL in GPU memory when a copy
of the weights fits there (the gather is a device-to-device copy and the buckets are broadcast from
device memory), else in pinned host memory, copied to the GPU chunk by chunk while the previous chunk
is on the wire.

Verification (``weight_sync.verify``): ``sampled`` (the default) and ``fingerprint`` are folded by the sender
and every receiver as the chunks pass and compared in band, ``sampled`` over one block in ``sample_stride``
at the phase ``phase_for(version)`` (filesystem transport: the full fingerprint, computed before the write,
checked after the read); ``sha256`` is hashed before the send and by every worker after its load; ``off``
checks nothing.

Per update: ask the controller for the live workers and probe each (``Stats``): a receiver that cannot be reached
is left out before the broadcast, which would wait for it to the group's timeout (a gloo broadcast does not end
when a receiver's process dies); (re-)form the broadcast group when membership changed; send one
UpdateWeights(manifest) per worker and broadcast the buckets while those calls are in flight. A worker that
acknowledged this layout in the current group gets the compact manifest (the layout named by id). A worker that
fails (dead, frozen, torn) is left out and the group is re-formed without it: the trainer carries on with the
rest. Filesystem transport: write shards, then the RPCs.

LoRA (``model.lora``): each update is an "adapter" manifest (the adapter's tensors and its ``LoraSpec``); a member
that has not loaded this trainer's "base" manifest (the frozen weights, staged once in ``arena_for(specs,
"base")``) gets it first, in an update of its own to those members only: at the start, and for a worker that
joins or restarts (a new address) later. ``SyncResult.nbytes`` counts both.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
import torch
from google.protobuf.message import Message

from relayrl.config import WeightSyncConfig
from relayrl.errors import rpc_error_text
from relayrl.rpc.channels import open_channel
from relayrl.rpc.retry import call_with_retry
from relayrl.runtime.ports import free_port
from relayrl.runtime.repeats import RepeatedWarning
from relayrl.v1 import controller_pb2, controller_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from relayrl.weightsync.arena import WeightArena, arena_placement
from relayrl.weightsync.checksum import weights_checksum
from relayrl.weightsync.errors import WeightSyncError
from relayrl.weightsync.filesystem import write_weights
from relayrl.weightsync.fingerprint import phase_for
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.weightsync.manifest import ManifestBuilder, Spec, WeightManifest
from relayrl.weightsync.sender import WeightSender
from relayrl.wire.lora import LoraAdapterSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SyncResult:
    version: int
    seconds: float
    synced: list[str]  # worker ids now at `version`
    failed: dict[str, str]  # worker id -> reason
    checksum: str
    nbytes: int  # payload bytes sent: the update's, plus the base weights' when some member needed them (LoRA)
    plan_wait_seconds: float = 0.0  # waiting for the controller's plan (a control-plane outage), not in `seconds`


class WeightPublisher:
    def __init__(
        self,
        cfg: WeightSyncConfig,
        controller: controller_pb2_grpc.ControllerServiceStub,
        weights_dir: str,
        *,
        lora: LoraAdapterSpec | None = None,
    ):
        self.cfg = cfg
        self.lora = lora
        self.controller = controller
        self.weights_dir = weights_dir
        self.backend = ("nccl" if torch.cuda.is_available() else "gloo") if cfg.backend == "auto" else cfg.backend
        self.device = "cuda" if self.backend == "nccl" else "cpu"
        self.sender = WeightSender(self.device)
        self.builder = ManifestBuilder(bucket_bytes=int(cfg.bucket_mib * (1 << 20)), transport=cfg.transport)
        self.repeats = RepeatedWarning(log)  # a worker left out of every step's sync: once every 10 steps
        self._arenas: dict[str, WeightArena] = {}  # by manifest kind
        self._layout_holders: dict[str, set[str]] = {}  # layout id -> the workers that hold it (this group)
        self._base_holders: set[tuple[str, str]] = set()  # (worker id, address) that loaded the base (LoRA)
        self.group: WeightBroadcastGroup | None = None
        self.members: list[tuple[str, str]] = []  # (worker id, address) in group-rank order
        self._stubs: dict[str, rollout_pb2_grpc.RolloutServiceStub] = {}
        self._silent_until: dict[str, tuple[float, str]] = {}  # address -> (monotonic time, why): not probed again
        self._probe_s = min(10.0, cfg.timeout_s / 2)  # a probe's deadline: room for a live worker on a busy machine

    def _stub(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        if address not in self._stubs:
            self._stubs[address] = rollout_pb2_grpc.RolloutServiceStub(open_channel(address))
        return self._stubs[address]

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.members = None, []
        self._layout_holders.clear()

    def arena_for(self, specs: list[Spec], kind: str = "full") -> WeightArena:
        """The arena the next update of ``kind`` is gathered into (reused while the specs stay the same)."""
        layout = self.builder.build(specs, version=0)
        arena = self._arenas.get(kind)
        if arena is None or not arena.fits(layout):
            self._arenas.pop(kind, None)  # free the old one first
            free = torch.cuda.mem_get_info()[0] if self.backend == "nccl" else None
            place = arena_placement(self.backend, sum(b.nbytes for b in layout.buckets), free)
            self._arenas[kind] = WeightArena(layout, place.device, pin_memory=place.pin_memory)
        return self._arenas[kind]

    def _form_group(self, members: list[tuple[str, str]]) -> dict[str, str]:
        """Build the group rank 0 + members; returns the members that failed to join (id -> reason)."""
        self.close()
        port = free_port()
        name = f"relayrl-{uuid.uuid4().hex[:10]}"
        futures = {
            wid: self._stub(addr).InitWeightSync.future(
                rollout_pb2.InitWeightSyncRequest(
                    master_address=self.cfg.master_address,
                    master_port=port,
                    rank=rank,
                    world_size=len(members) + 1,
                    group_name=name,
                    backend=self.backend,
                    timeout_s=self.cfg.timeout_s,
                ),
                timeout=self.cfg.timeout_s,
            )
            for rank, (wid, addr) in enumerate(members, start=1)
        }
        try:
            group = WeightBroadcastGroup(
                self.cfg.master_address,
                port,
                0,
                len(members) + 1,
                group_name=name,
                backend=self.backend,
                timeout_s=self.cfg.timeout_s,
                device=self.device,
            )  # returns once every member has connected (gloo/NCCL rendezvous through the store)
        except (WeightSyncError, RuntimeError) as err:
            failed = _failures(futures) or {wid: f"group formation failed: {err}" for wid, _ in members}
            return failed
        failed = _failures(futures)
        if failed:
            group.close()
            return failed
        self.group, self.members = group, members
        return {}

    def publish(
        self, version: int, weights: WeightArena, only: set[str] | None = None, kind: str = "full"
    ) -> SyncResult:
        """Bring every live worker (or the workers in ``only``) to ``version`` of ``weights`` (an arena from
        ``arena_for``; ``kind`` as in its manifest: "full", or with LoRA "adapter", preceded by the base where a
        member lacks it, or "base"). Never raises for a worker's failure; reports it. ``seconds`` is the update's
        own time: the wait for the controller's plan (it may be restarting) is ``plan_wait_seconds``."""
        start = time.perf_counter()
        plan_wait, base_bytes = 0.0, 0
        manifest = weights.manifest.with_header(
            version=version,
            path=self.weights_dir if self.cfg.transport == "filesystem" else "",
            transport=self.cfg.transport,
            **self._verification(version, weights),
            kind=kind,
            lora=None if kind == "full" else self.lora,
        )
        failed: dict[str, str] = {}
        synced: list[str] = []
        checksum = manifest.checksum  # out of band; in band it comes from the transfer, if one happens
        for _attempt in range(3):
            asked = time.perf_counter()
            plan = call_with_retry(
                partial(
                    self.controller.GetWeightSyncPlan,
                    controller_pb2.GetWeightSyncPlanRequest(version=version),
                    timeout=30,
                ),
                what="GetWeightSyncPlan",
                deadline_s=600,
            )
            plan_wait += time.perf_counter() - asked
            planned = [w for w in plan.workers if w.worker_id not in failed and (only is None or w.worker_id in only)]
            # a receiver that cannot be reached is left out before the broadcast, which would wait for it
            failed.update(self._unreachable({w.worker_id: w.address for w in planned}))
            members = [(w.worker_id, w.address) for w in planned if w.worker_id not in failed]
            lacking = {wid for wid, addr in members if (wid, addr) not in self._base_holders}
            if kind == "adapter" and lacking:
                base = self.publish(version, self._arenas["base"], only=lacking, kind="base")
                failed.update(base.failed)
                plan_wait += base.plan_wait_seconds
                base_bytes += base.nbytes if base.synced else 0
                members = [m for m in members if m in self._base_holders]
            if not members:
                break
            if self.cfg.transport == "filesystem":
                write_weights(self.weights_dir, manifest, dict(weights.views()))
                outcome, checksum = self._update(members, manifest, None, weights)
            else:
                if members != self.members or self.group is None:
                    failed.update(self._form_group(members))
                    if self.group is None:
                        continue
                outcome, checksum = self._update(self.members, manifest, self.group, weights)
            synced = [wid for wid, reason in outcome.items() if reason is None]
            broken = {wid: reason for wid, reason in outcome.items() if reason is not None}
            if not broken:
                break
            addresses = dict(members)
            dead = self._unreachable({wid: addresses[wid] for wid in broken})
            failed.update({wid: broken[wid] for wid in dead})
            self.close()
        for wid, reason in failed.items():
            self.repeats.warn(f"left out {wid}", "weight sync v%d: worker %s left out: %s", version, wid, reason)
        seconds = time.perf_counter() - start - plan_wait
        return SyncResult(version, seconds, synced, failed, checksum, manifest.total_bytes + base_bytes, plan_wait)

    def _verification(self, version: int, weights: WeightArena) -> dict[str, str | int]:
        """The manifest's header fields that say how receivers check update ``version`` (module docstring)."""
        if self.cfg.verify == "off":
            return {"verify": "off"}
        if self.cfg.transport != "broadcast" or self.cfg.verify == "sha256":  # checked against a checksum
            method = "sha256" if self.cfg.verify == "sha256" else "fingerprint"
            return {"checksum": weights_checksum(weights.views(), method=method)}
        if self.cfg.verify == "sampled":
            stride = self.cfg.sample_stride
            return {"verify": "sampled", "sample_stride": stride, "sample_phase": phase_for(version, stride)}
        return {"verify": "fingerprint"}

    def _update(
        self, members: list[tuple[str, str]], manifest: WeightManifest, group, weights: WeightArena
    ) -> tuple[dict[str, str | None], str]:
        """UpdateWeights on every member while (broadcast transport) the buckets go out; the outcome per
        member and the checksum the members were checked against (in band: the sender's fingerprint)."""
        group_name = group.group_name if group else ""
        full = rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto(), group_name=group_name)
        compact = rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto(compact=True), group_name=group_name)
        holders = self._layout_holders.setdefault(manifest.layout_id, set())
        futures = {
            wid: self._stub(addr).UpdateWeights.future(
                compact if wid in holders else full, timeout=self.cfg.timeout_s * 2
            )
            for wid, addr in members
        }
        send_error, expected = None, manifest.checksum
        released: dict[str, str] = {}  # member -> why its call was cancelled
        with ThreadPoolExecutor(1, thread_name_prefix="update-watch") as pool:
            # the update is collective: one member's failure (a receiver that died) fails it for all, so the group
            # is closed (this rank's send stops waiting) and the others are released (_answers) at once
            watch = pool.submit(
                self._answers, futures, dict(members), group.close if group is not None else None, released
            )
            if group is not None:
                try:
                    expected = self.sender.send(group, manifest, weights).checksum or expected
                except WeightSyncError as err:
                    send_error = str(err)
                    group.close()
                    _release(futures, f"released: this update's broadcast failed ({send_error})", released)
            answers = watch.result()
        outcome: dict[str, str | None] = {}
        for wid, answer in answers.items():
            if isinstance(answer, str):
                outcome[wid] = answer
                continue
            same = not expected or answer.checksum == expected
            # a base load leaves the worker at its adapter's version
            ok = (manifest.kind == "base" or answer.policy_version == manifest.version) and same
            outcome[wid] = None if ok else f"loaded version {answer.policy_version} checksum mismatch"
        if send_error and all(reason is None for reason in outcome.values()):
            outcome = {wid: f"broadcast failed: {send_error}" for wid in outcome}
        addresses = dict(members)
        for wid, reason in outcome.items():
            if reason is None:
                holders.add(wid)
                if manifest.kind == "base":
                    self._base_holders.add((wid, addresses[wid]))
            else:
                holders.discard(wid)
        return outcome, expected

    def _answers(
        self,
        calls: dict[str, grpc.Future],
        addresses: dict[str, str],
        on_failure: Callable[[], None] | None = None,
        released: dict[str, str] | None = None,
    ) -> dict[str, rollout_pb2.UpdateWeightsResponse | str]:
        """Each member's UpdateWeights answer, or why it has none. While calls are out, the members that have
        not answered by the end of each probe period are probed (``_unreachable``); one that misses its probe
        is left out at once, its call cancelled: a worker frozen during an update costs at most two probe
        periods (timeout_s), not the call's deadline (2 x timeout_s) and then a probe.

        ``on_failure`` is given for a collective update, which no member can finish once one has failed: it is called
        once, when a call fails or a probe leaves a member out (this rank's send is then ended), and the calls still
        out are cancelled. A receiver's server then closes its group, which ends its wait for bytes this update will not
        send (gloo cannot abort one from here: relayrl.weightsync.group). ``released``: why calls were cancelled
        (by this thread or another), their answer."""
        released = {} if released is None else released
        answered = threading.Event()
        for call in calls.values():
            call.add_done_callback(lambda _call: answered.set())
        answers: dict[str, rollout_pb2.UpdateWeightsResponse | str] = {}
        pending = dict(calls)
        next_probe = time.monotonic() + self._probe_s
        while pending:
            answered.clear()
            for wid in [wid for wid, call in pending.items() if call.done()]:
                answer = _answer(pending.pop(wid))
                answers[wid] = released.get(wid, answer) if answer == _CANCELLED else answer
            failed = [wid for wid, answer in answers.items() if isinstance(answer, str) and wid not in released]
            if failed and on_failure is not None:  # this rank's send is out too, even when no other call is
                on_failure()
                on_failure = None
                _release(pending, f"released: {failed[0]} failed during this update ({answers[failed[0]]})", released)
            elif pending and not answered.wait(max(0.0, next_probe - time.monotonic())):
                # no call ended within the probe period: probe the members still out
                for wid, why in self._unreachable({wid: addresses[wid] for wid in pending}).items():
                    if pending[wid].cancel():
                        answers[wid] = f"{why} (during the update)"
                        del pending[wid]
                next_probe = time.monotonic() + self._probe_s
        return answers

    def _unreachable(self, workers: dict[str, str]) -> dict[str, str]:
        """Of ``workers`` (id -> address), those that do not answer Stats within min(10 s, timeout_s / 2), probed
        at once: a refused connection fails in milliseconds, a frozen process at the deadline. An address that
        failed is not probed again for ``timeout_s`` (a frozen worker costs one probe per period, not one per
        update); a restarted worker has a new address."""
        now = time.monotonic()
        dead = {wid: why for wid, addr in workers.items() if (why := self._silent(addr, now))}
        probes = {
            wid: self._stub(addr).Stats.future(rollout_pb2.StatsRequest(), timeout=self._probe_s)
            for wid, addr in workers.items()
            if wid not in dead
        }
        for wid, probe in probes.items():
            try:
                probe.result()
            except grpc.RpcError as err:
                dead[wid] = f"unreachable: {rpc_error_text(err)}"
                self._silent_until[workers[wid]] = (time.monotonic() + self.cfg.timeout_s, dead[wid])
        return dead

    def _silent(self, address: str, now: float) -> str:
        """Why ``address`` is still left out without a probe ("" once its period is over)."""
        until, why = self._silent_until.get(address, (0.0, ""))
        if now >= until:
            self._silent_until.pop(address, None)
            return ""
        return f"{why} (not probed again for {until - now:.0f}s)"


def _answer(call: grpc.Future) -> Message | str:
    """A call's response once it is done (it waits), or why it failed, as a string."""
    try:
        return call.result()
    except grpc.RpcError as err:
        return rpc_error_text(err)
    except grpc.FutureCancelledError:
        return _CANCELLED


_CANCELLED = "cancelled"


def _release(calls: dict[str, grpc.Future], why: str, released: dict[str, str]) -> None:
    """Cancel the calls still out and say ``why`` in ``released`` (a call that ended first keeps its answer)."""
    for wid, call in list(calls.items()):
        if call.cancel():
            released.setdefault(wid, why)


def _failures(calls: dict[str, grpc.Future]) -> dict[str, str]:
    """The InitWeightSync calls that failed: member id -> why."""
    return {wid: f"InitWeightSync {why}" for wid, call in calls.items() if isinstance(why := _answer(call), str)}
