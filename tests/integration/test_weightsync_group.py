"""Weight sync across real processes: a sender (this process) and receivers started as OS processes,
talking over a WeightBroadcastGroup (gloo on loopback)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from relayrl.bench.weightsync import random_tensors
from relayrl.v1 import common_pb2 as pb
from relayrl.weightsync import (
    BufferPair,
    LayoutCache,
    ManifestBuilder,
    WeightArena,
    WeightBroadcastGroup,
    WeightMismatch,
    WeightSender,
    WeightSyncError,
    WeightSyncTimeout,
    build_manifest,
    fingerprint,
    receive_into,
    receive_weights,
    weights_checksum,
)

pytestmark = pytest.mark.slow

BUCKET_BYTES = 1 << 20
CHUNK_BYTES = 256 << 10  # several chunks per bucket: packing, transfer and loading pipeline
SPECS = [
    ("embed", (512, 256), torch.bfloat16),  # 256 KiB
    *((f"layers.{i}.w", (256, 512), torch.float32) for i in range(6)),  # 512 KiB each
    *((f"layers.{i}.norm", (256,), torch.float32) for i in range(6)),
    ("big", (700, 1024), torch.bfloat16),  # 1.37 MiB: a bucket of its own
    ("position_ids", (1000,), torch.int64),
]


def receiver_main(rank: int, inbox: Any, outbox: Any, die_signal: int | None) -> None:
    """A rollout worker stand-in: joins groups and receives updates as the inbox says, reports back.

    With ``die_signal`` it sends itself that signal inside load_fn (SIGKILL: dies, SIGSTOP: hangs). A
    message ending in "corrupt" flips one byte of the first chunk that lands, before it is fingerprinted."""
    torch.set_num_threads(1)
    params: dict[str, torch.Tensor] = {n: torch.zeros(s, dtype=d) for n, s, d in SPECS}
    buffers = BufferPair("cpu")
    layouts = LayoutCache()
    arena: WeightArena | None = None
    group: WeightBroadcastGroup | None = None

    def load(views: list[tuple[str, torch.Tensor]]) -> None:
        if die_signal is not None:
            os.kill(os.getpid(), die_signal)
        for name, view in views:
            params[name].copy_(view)

    while True:
        kind, *args = inbox.get(timeout=300)
        if kind == "join":
            port, group_rank, world_size, name = args
            group = WeightBroadcastGroup(
                "127.0.0.1", port, group_rank, world_size, name, timeout_s=5.0, chunk_bytes=CHUNK_BYTES
            )
            outbox.put(("ready", rank))
        elif kind in ("weights", "in_place"):
            corrupt_next_chunk(args[-1] == "corrupt")
            manifest = layouts.resolve(pb.WeightManifest.FromString(args[0]))
            manifest.validate_against(SPECS)
            try:
                if kind == "in_place":
                    if arena is None or not arena.fits(manifest):
                        arena = WeightArena.adopt(manifest, params)
                    stats = receive_into(group, manifest, arena)
                    assert all(params[name].data_ptr() == view.data_ptr() for name, view in arena.views())
                else:
                    stats = receive_weights(group, manifest, load, device="cpu", buffers=buffers)
            except WeightSyncError as exc:
                group.close()
                outbox.put(("error", rank, type(exc).__name__))
                continue
            except WeightMismatch as exc:  # the group is fine: keep it
                outbox.put(("mismatch", rank, str(exc)))
                continue
            checksum = weights_checksum(params.items())
            outbox.put(("ok", rank, checksum, stats.peak_extra_bytes, stats.buckets, stats.checksum))
        else:
            return


def corrupt_next_chunk(on: bool, fold=fingerprint.Fingerprinter.add) -> None:
    """While ``on``, the first chunk a Fingerprinter is given has one byte flipped first (in the received
    weights themselves: a corrupted landing), in the sampled block nearest its middle (any block when
    every block is read); off restores the real ``add``."""
    if not on:
        fingerprint.Fingerprinter.add = fold
        return

    def add(self, bucket: int, start: int, data: torch.Tensor) -> None:
        stride, blocks = self.sampling.stride, data.numel() // fingerprint.BLOCK
        skip = self.sampling.skip(start // fingerprint.BLOCK)
        data[(skip + (blocks - skip) // (2 * stride) * stride) * fingerprint.BLOCK + 5] ^= 0x10
        fingerprint.Fingerprinter.add = fold
        fold(self, bucket, start, data)

    fingerprint.Fingerprinter.add = add


# Receivers are forked from multiprocessing's fork server, which imported torch and relayrl's weight sync once (a
# fresh interpreter per receiver imported them again: seconds of a core each); each is still its own OS process,
# forked from a process with no thread but its main one, never from this one (its gloo and gRPC threads). Named by
# package: Python 3.11's fork server ignores the sys.path it is given, so a test module named here is not preloaded.
FORKS = mp.get_context("forkserver")
FORKS.set_forkserver_preload(["torch", "relayrl.weightsync", "relayrl.bench.weightsync"])


class Receivers:
    """Receiver processes, forked from ``FORKS``, with one inbox each and a shared outbox."""

    def __init__(self, ranks_dying: dict[int, int | None]) -> None:
        self.outbox = FORKS.Queue()
        self.inboxes = {rank: FORKS.Queue() for rank in ranks_dying}
        self.procs = {
            rank: FORKS.Process(target=receiver_main, args=(rank, self.inboxes[rank], self.outbox, dies), daemon=True)
            for rank, dies in ranks_dying.items()
        }
        for proc in self.procs.values():
            proc.start()

    def tell(self, ranks: list[int], *message: object) -> None:
        for rank in ranks:
            self.inboxes[rank].put(message)

    def replies(self, n: int) -> list[tuple]:
        return sorted((self.outbox.get(timeout=300) for _ in range(n)), key=lambda r: r[1])

    def join(self, ranks: list[int], group: WeightBroadcastGroup) -> None:
        """Tell ``ranks`` to join ``group`` as group ranks 1, 2, ...; wait until each has built it."""
        for group_rank, rank in enumerate(ranks, start=1):
            self.inboxes[rank].put(("join", group.port, group_rank, group.world_size, group.group_name))
        assert [r[0] for r in self.replies(len(ranks))] == ["ready"] * len(ranks)

    def close(self) -> None:
        for rank, proc in self.procs.items():
            if proc.is_alive():
                self.inboxes[rank].put(("stop",))
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


@pytest.fixture
def receivers_factory() -> Iterator[Any]:
    made: list[Receivers] = []

    def make(ranks_dying: dict[int, int | None]) -> Receivers:
        made.append(Receivers(ranks_dying))
        return made[-1]

    yield make
    for receivers in made:
        receivers.close()


def test_two_receivers_get_bit_identical_weights_across_buckets(receivers_factory: Any) -> None:
    receivers = receivers_factory({1: None, 2: None})
    sender = WeightSender("cpu")
    with WeightBroadcastGroup("127.0.0.1", 0, 0, 3, "ws-it-1", timeout_s=10.0, chunk_bytes=CHUNK_BYTES) as group:
        receivers.join([1, 2], group)
        for version in (1, 2):  # the second update reuses every buffer
            tensors = random_tensors(SPECS, seed=version)
            manifest = build_manifest(SPECS, version=version, bucket_bytes=BUCKET_BYTES)
            assert len(manifest.buckets) >= 4
            receivers.tell([1, 2], "weights", manifest.to_proto().SerializeToString())
            stats = sender.send(group, manifest, tensors)
            assert stats.nbytes == manifest.total_bytes and stats.gbps > 0
            replies = receivers.replies(2)
            expected = weights_checksum(tensors.items())
            two_buckets = sum(sorted(b.nbytes for b in manifest.buckets)[-2:])
            for kind, _rank, checksum, peak, buckets, _ in replies:
                assert (kind, checksum, buckets) == ("ok", expected, len(manifest.buckets))
                assert peak <= two_buckets


def test_in_place_and_staged_receivers_match_from_an_arena_or_from_tensors_with_compact_manifests(
    receivers_factory: Any,
) -> None:
    """Receiver 1 holds its parameters in an arena (received in place, no staging), receiver 2 stages;
    the sender sends from its own arena (nothing to pack), packs from tensors, or stages an arena that
    lives off the group's device chunk by chunk (as a pinned CPU arena feeds NCCL). After the first
    update the manifest travels compact (layout by id) and both resolve it from their LayoutCache.
    Every update is fingerprinted in band: sender and receivers fold the chunks as they pass, and all
    three values equal the fingerprint of the tensors."""
    receivers = receivers_factory({1: None, 2: None})
    sender, builder = WeightSender("cpu"), ManifestBuilder(bucket_bytes=BUCKET_BYTES)
    with WeightBroadcastGroup("127.0.0.1", 0, 0, 3, "ws-it-4", timeout_s=10.0, chunk_bytes=CHUNK_BYTES) as group:
        receivers.join([1, 2], group)
        for version, source_kind in ((1, "arena"), (2, "tensors"), (3, "arena"), (4, "arena elsewhere")):
            tensors = random_tensors(SPECS, seed=version)
            manifest = builder.build(SPECS, version=version, verify="fingerprint")
            wire = manifest.to_proto(compact=version > 1)
            assert (len(wire.tensors) == 0) == (version > 1)
            receivers.tell([1], "in_place", wire.SerializeToString())
            receivers.tell([2], "weights", wire.SerializeToString())
            source: Any = tensors
            if source_kind != "tensors":
                source = WeightArena(manifest)
                source.load(tensors.items())
            if source_kind == "arena elsewhere":
                source.device = torch.device("meta")  # not the group's device: staged a chunk at a time
            stats = sender.send(group, manifest, source)
            assert (stats.peak_extra_bytes == 0) == (source_kind == "arena")
            in_place, staged = receivers.replies(2)
            expected = weights_checksum(tensors.items())
            assert in_place[:3] == ("ok", 1, expected) and in_place[3] == 0  # no staging memory at all
            assert staged[:3] == ("ok", 2, expected) and staged[3] > 0
            assert stats.checksum == in_place[5] == staged[5] == expected


@pytest.mark.parametrize("verify", ["fingerprint", "sampled"])
def test_a_byte_flipped_as_it_lands_fails_that_receiver_and_the_send_and_the_group_goes_on(
    receivers_factory: Any, verify: str
) -> None:
    """Receiver 1 (in place) gets one byte flipped in a chunk as it lands (sampled: in a block the update
    samples); it raises WeightMismatch, the sender's vote fails, receiver 2 holds the right weights. The
    group stays in step: the next update reaches both, and all three fold the value computed directly from
    the tensors (sampled: at that version's phase)."""
    receivers = receivers_factory({1: None, 2: None})
    sender, builder = WeightSender("cpu"), ManifestBuilder(bucket_bytes=BUCKET_BYTES)
    stride = 64 if verify == "sampled" else 0
    with WeightBroadcastGroup("127.0.0.1", 0, 0, 3, "ws-it-5", timeout_s=10.0, chunk_bytes=CHUNK_BYTES) as group:
        receivers.join([1, 2], group)
        for version, corrupt in ((1, "corrupt"), (2, "clean")):
            tensors = random_tensors(SPECS, seed=version)
            phase = fingerprint.phase_for(version, stride) if stride else 0
            manifest = builder.build(SPECS, version=version, verify=verify, sample_stride=stride, sample_phase=phase)
            receivers.tell([1], "in_place", manifest.to_proto().SerializeToString(), corrupt)
            receivers.tell([2], "weights", manifest.to_proto().SerializeToString(), "clean")
            expected = weights_checksum(tensors.items())
            if corrupt == "corrupt":
                with pytest.raises(WeightSyncError, match="holds other bytes than were sent"):
                    sender.send(group, manifest, tensors)
                mismatch, fine = receivers.replies(2)
                assert mismatch[:2] == ("mismatch", 1) and "checksum" in mismatch[2]
                assert fine[:3] == ("ok", 2, expected)
            else:
                stats = sender.send(group, manifest, tensors)
                replies = receivers.replies(2)
                assert [r[:3] for r in replies] == [("ok", 1, expected), ("ok", 2, expected)]
                folded = fingerprint.manifest_fingerprint(manifest, list(tensors.items()))
                assert stats.checksum == replies[0][5] == replies[1][5] == folded and not group.broken
                assert folded.startswith("fs:" if stride else "fp:")


def test_killed_receiver_fails_the_send_within_the_timeout_then_a_new_group_works(
    receivers_factory: Any,
) -> None:
    receivers = receivers_factory({1: None, 2: signal.SIGKILL})  # rank 2 dies inside load_fn
    manifest = build_manifest(SPECS, version=1, bucket_bytes=BUCKET_BYTES)
    tensors = random_tensors(SPECS, seed=1)
    group = WeightBroadcastGroup("127.0.0.1", 0, 0, 3, "ws-it-2", timeout_s=5.0, chunk_bytes=CHUNK_BYTES)
    receivers.join([1, 2], group)
    receivers.tell([1, 2], "weights", manifest.to_proto().SerializeToString())
    start = time.monotonic()
    with pytest.raises(WeightSyncError):
        WeightSender("cpu").send(group, manifest, tensors)
    assert time.monotonic() - start < 5.0 + 2.0
    assert group.broken
    group.close()
    assert receivers.replies(1)[0][:2] == ("error", 1)
    receivers.procs[2].join(timeout=10)
    assert receivers.procs[2].exitcode == -signal.SIGKILL

    with WeightBroadcastGroup("127.0.0.1", 0, 0, 2, "ws-it-2-gen2", timeout_s=5.0, chunk_bytes=CHUNK_BYTES) as group2:
        receivers.join([1], group2)
        manifest2 = build_manifest(SPECS, version=2, bucket_bytes=BUCKET_BYTES)
        tensors2 = random_tensors(SPECS, seed=2)
        receivers.tell([1], "weights", manifest2.to_proto().SerializeToString())
        WeightSender("cpu").send(group2, manifest2, tensors2)
        kind, _rank, checksum, *_ = receivers.replies(1)[0]
        assert (kind, checksum) == ("ok", weights_checksum(tensors2.items()))


def test_hanging_receiver_times_out_the_send(receivers_factory: Any) -> None:
    receivers = receivers_factory({1: signal.SIGSTOP})  # stops inside load_fn: its sockets stay open
    manifest = build_manifest(SPECS, version=1, bucket_bytes=BUCKET_BYTES)
    with WeightBroadcastGroup("127.0.0.1", 0, 0, 2, "ws-it-3", timeout_s=2.0, chunk_bytes=CHUNK_BYTES) as group:
        receivers.join([1], group)
        receivers.tell([1], "weights", manifest.to_proto().SerializeToString())
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeout):
            WeightSender("cpu").send(group, manifest, random_tensors(SPECS, seed=1))
        assert time.monotonic() - start < 2.0 + 2.0
    receivers.procs[1].kill()  # SIGKILL ends a stopped process too
