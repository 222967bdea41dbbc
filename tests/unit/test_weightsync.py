"""Unit tests for relayrl.weightsync: manifest layout, packing views, filesystem fallback, checksum."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch

from relayrl.bench.weightsync import model_specs, random_tensors
from relayrl.errors import FailedPrecondition
from relayrl.runtime.ports import free_port
from relayrl.weightsync import (
    BucketSpec,
    LayoutCache,
    ManifestBuilder,
    TensorSpec,
    UnknownLayout,
    WeightArena,
    WeightBroadcastGroup,
    WeightManifest,
    WeightSyncError,
    build_manifest,
    latest_version,
    pack_bucket,
    read_weights,
    unpack_bucket,
    weights_checksum,
    write_weights,
)
from relayrl.weightsync.checksum import Method, checksum_method
from relayrl.weightsync.manifest import ALIGN, nbytes_of
from relayrl.weightsync.packing import transfer_chunks

SPECS = [
    ("embed", (10, 8), torch.bfloat16),  # 160 B
    ("norm", (8,), torch.float32),  # 32 B
    ("q", (8, 8), torch.bfloat16),  # 128 B
    ("step", (3,), torch.int64),  # 24 B
    ("big", (40, 10), torch.bfloat16),  # 800 B > bucket_bytes: a bucket of its own
    ("bias", (5,), torch.float32),  # 20 B
    ("k", (4, 8), torch.bfloat16),  # 64 B
]


@pytest.fixture
def manifest() -> WeightManifest:
    return build_manifest(SPECS, version=7, bucket_bytes=512)


def test_layout_per_dtype_aligned_and_bounded(manifest: WeightManifest) -> None:
    by_name = {t.name: t for t in manifest.tensors}
    # bfloat16 first (first seen), in given order: embed@0, q@256 (align 160 -> 256); big needs its own
    # bucket; k goes to a fresh bucket after big (256+128 -> 512, +64 > 512 would not fit anyway).
    assert [(b.dtype, b.nbytes) for b in manifest.buckets] == [
        (torch.bfloat16, 384),
        (torch.bfloat16, 800),
        (torch.bfloat16, 64),
        (torch.float32, 276),
        (torch.int64, 24),
    ]
    assert (by_name["embed"].bucket, by_name["embed"].offset) == (0, 0)
    assert (by_name["q"].bucket, by_name["q"].offset) == (0, 256)
    assert (by_name["big"].bucket, by_name["big"].offset, by_name["big"].nbytes) == (1, 0, 800)
    assert (by_name["k"].bucket, by_name["k"].offset) == (2, 0)
    assert (by_name["norm"].bucket, by_name["norm"].offset) == (3, 0)
    assert (by_name["bias"].bucket, by_name["bias"].offset) == (3, 256)
    assert [t.name for t in manifest.tensors] == ["embed", "q", "big", "k", "norm", "bias", "step"]
    for t in manifest.tensors:
        assert t.offset % ALIGN == 0
        assert manifest.buckets[t.bucket].dtype == t.dtype
        assert t.offset + t.nbytes <= manifest.buckets[t.bucket].nbytes
    assert all(b.nbytes <= 512 for b in manifest.buckets if b.index != 1)
    assert manifest.total_bytes == 160 + 32 + 128 + 24 + 800 + 20 + 64


def test_layout_is_deterministic_and_fills_buckets() -> None:
    specs = [(f"w{i}", (64,), torch.float32) for i in range(10)]  # 256 B each, 4 per 1 KiB bucket
    a = build_manifest(specs, version=1, bucket_bytes=1024)
    assert a == build_manifest(specs, version=1, bucket_bytes=1024)
    assert [t.bucket for t in a.tensors] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert [b.nbytes for b in a.buckets] == [1024, 1024, 512]


def test_proto_and_json_round_trip(manifest: WeightManifest) -> None:
    with_meta = dataclasses.replace(manifest, checksum="abc", transport="filesystem", path="/x", verify="off")
    msg = with_meta.to_proto()
    assert msg.tensors[0].dtype == "bfloat16" and list(msg.tensors[0].shape) == [10, 8]
    assert WeightManifest.from_proto(msg) == with_meta
    assert WeightManifest.from_proto(type(msg).FromString(msg.SerializeToString())) == with_meta
    assert WeightManifest.from_json(with_meta.to_json()) == with_meta


def test_validate_against_names_the_first_mismatch(manifest: WeightManifest) -> None:
    manifest.validate_against(SPECS)
    with pytest.raises(ValueError, match=r"^q: shape \[8, 8\] in the manifest, \[8, 9\]"):
        manifest.validate_against([*SPECS[:2], ("q", (8, 9), torch.bfloat16), ("step", (4,), torch.int64)])
    with pytest.raises(ValueError, match=r"^norm: dtype float32 in the manifest, bfloat16"):
        manifest.validate_against([SPECS[0], ("norm", (8,), torch.bfloat16)])
    with pytest.raises(ValueError, match=r"^extra: missing"):
        manifest.validate_against([*SPECS, ("extra", (1,), torch.float32)])
    with pytest.raises(ValueError, match=r"^k: in the manifest but not expected"):
        manifest.validate_against(SPECS[:-1])


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (TensorSpec("a", (4,), torch.float32, 0, 8, 16), r"^a: offset 8 is misaligned or outside"),
        (TensorSpec("a", (4,), torch.float32, 0, 0, 12), r"^a: nbytes 12 does not match"),
        (TensorSpec("a", (4,), torch.bfloat16, 0, 0, 8), r"^a: dtype bfloat16 in a float32 bucket"),
        (TensorSpec("a", (4,), torch.float32, 3, 0, 16), r"^a: bucket 3 does not exist"),
    ],
)
def test_inconsistent_wire_manifest_is_rejected(tensor: TensorSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WeightManifest(1, (tensor,), (BucketSpec(0, torch.float32, 16),))


def test_overlap_and_unknown_dtype_are_rejected() -> None:
    bucket = (BucketSpec(0, torch.float32, 32),)
    with pytest.raises(ValueError, match=r"^b: overlaps a"):
        WeightManifest(
            1, (TensorSpec("a", (4,), torch.float32, 0, 0, 16), TensorSpec("b", (4,), torch.float32, 0, 8, 16)), bucket
        )
    msg = build_manifest([("a", (2,), torch.float32)], version=1).to_proto()
    msg.tensors[0].dtype = "no_such_dtype"
    with pytest.raises(ValueError, match="unknown torch dtype 'no_such_dtype'"):
        WeightManifest.from_proto(msg)


def test_pack_unpack_round_trip_returns_views(manifest: WeightManifest) -> None:
    tensors = random_tensors(SPECS)
    for bucket in manifest.buckets:
        out = torch.full((bucket.nbytes + 64,), 0xAB, dtype=torch.uint8)
        flat = pack_bucket(bucket, tensors, manifest, out)
        assert flat.numel() == bucket.nbytes and flat.data_ptr() == out.data_ptr()
        views = unpack_bucket(out, bucket, manifest)
        assert [n for n, _ in views] == [t.name for t in manifest.bucket_tensors(bucket.index)]
        start, end = out.data_ptr(), out.data_ptr() + out.numel()
        for name, view in views:
            assert view.dtype == tensors[name].dtype and view.shape == tensors[name].shape
            assert torch.equal(view, tensors[name])
            assert start <= view.data_ptr() < end  # a view into the buffer, not a copy
            assert view.data_ptr() % ALIGN == out.data_ptr() % ALIGN
        first_name, first_view = views[0]
        spec = manifest.bucket_tensors(bucket.index)[0]
        out[spec.offset : spec.offset + spec.nbytes] = 0  # the buffer changes under the view
        assert first_name == spec.name and not first_view.any()


def test_pack_accepts_non_contiguous_sources_and_rejects_mismatches(manifest: WeightManifest) -> None:
    tensors = random_tensors(SPECS)
    tensors["q"] = tensors["q"].t().contiguous().t()  # same values, transposed strides
    bucket = manifest.buckets[0]
    out = torch.empty(bucket.nbytes, dtype=torch.uint8)
    views = dict(unpack_bucket(pack_bucket(bucket, tensors, manifest, out), bucket, manifest))
    assert torch.equal(views["q"], tensors["q"])
    tensors["q"] = tensors["q"].float()
    with pytest.raises(ValueError, match=r"^q: got float32 \[8, 8\], the manifest says bfloat16 \[8, 8\]"):
        pack_bucket(bucket, tensors, manifest, out)
    with pytest.raises(ValueError, match="out: need a uint8 buffer"):
        pack_bucket(bucket, tensors, manifest, torch.empty(8, dtype=torch.uint8))


def test_transfer_chunks_cover_every_byte_and_tensor_once() -> None:
    specs = [("a", (100,), torch.float32), ("b", (1000,), torch.float32), ("c", (10,), torch.float32)]
    m = build_manifest(specs, version=1)  # a@0 (400 B), b@512 (4000 B), c@4608 (40 B): 4648 B
    chunks = transfer_chunks(m, m.buckets[0], chunk_bytes=1024)
    assert [(c.start, c.end) for c in chunks] == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096), (4096, 4648)]
    assert [[t.name for t in c.to_pack] for c in chunks] == [["a", "b"], [], [], [], ["c"]]
    assert [[t.name for t in c.complete] for c in chunks] == [["a"], [], [], [], ["b", "c"]]
    whole = transfer_chunks(m, m.buckets[0], chunk_bytes=1 << 20)
    assert [(c.start, c.end, len(c.to_pack), len(c.complete)) for c in whole] == [(0, 4648, 3, 3)]
    with_empty = build_manifest([*specs, ("empty", (0, 4), torch.float32)], version=1)  # at offset 4864 = end
    last = transfer_chunks(with_empty, with_empty.buckets[0], chunk_bytes=1024)[-1]
    assert [t.name for t in last.to_pack] == ["c", "empty"]
    assert [t.name for t in last.complete] == ["b", "c", "empty"]


def _collect(into: dict[str, torch.Tensor]) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
    """A load_fn that keeps a copy of every view (the views die with the buffer)."""

    def load(views: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in views:
            into[name] = t.clone()

    return load


def test_filesystem_round_trip_is_bit_identical(tmp_path: Path, manifest: WeightManifest) -> None:
    tensors = random_tensors(SPECS)
    tensors["tied"] = tensors["embed"]  # shares storage: safetensors would refuse it uncopied
    m = build_manifest([*SPECS, ("tied", (10, 8), torch.bfloat16)], version=7, bucket_bytes=512)
    assert latest_version(tmp_path) is None
    write_weights(tmp_path, m, tensors)
    assert latest_version(tmp_path) == 7
    got: dict[str, torch.Tensor] = {}
    stats = read_weights(tmp_path, m, _collect(got))
    assert stats.nbytes == m.total_bytes and stats.buckets == len(m.buckets)
    assert weights_checksum(got.items()) == weights_checksum(tensors.items())
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


def test_filesystem_version_check_and_pruning(tmp_path: Path, manifest: WeightManifest) -> None:
    tensors = random_tensors(SPECS)
    for version in (1, 2, 3):
        write_weights(tmp_path, dataclasses.replace(manifest, version=version), tensors, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "v0000000002", "v0000000003"]
    write_weights(tmp_path, dataclasses.replace(manifest, version=1), tensors, keep=1)  # a resumed trainer
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "v0000000001"]
    write_weights(tmp_path, dataclasses.replace(manifest, version=3), tensors, keep=2)
    with pytest.raises(FailedPrecondition, match="publishes 3, the manifest brings 2"):
        read_weights(tmp_path, dataclasses.replace(manifest, version=2), _collect({}))
    other = build_manifest(SPECS, version=3, bucket_bytes=4096)
    with pytest.raises(FailedPrecondition, match="layout stored for version 3 differs"):
        read_weights(tmp_path, other, _collect({}))


def test_a_version_that_cannot_be_pruned_is_a_warning_naming_it(
    tmp_path: Path, manifest: WeightManifest, caplog: pytest.LogCaptureFixture
) -> None:
    """An old version rmtree cannot delete (here a symlink, which rmtree refuses) is logged at WARNING with its
    path, not ignored: full copies of the model must not pile up unseen. The publish itself succeeds."""
    tensors = random_tensors(SPECS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "weights"
    root.mkdir()
    (root / "v0000000001").symlink_to(elsewhere, target_is_directory=True)
    with caplog.at_level("WARNING", logger="relayrl.weightsync.filesystem"):
        write_weights(root, dataclasses.replace(manifest, version=2), tensors, keep=1)
    assert latest_version(root) == 2
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "v0000000001" in r.getMessage()]
    assert warned, caplog.text


def test_marker_is_replaced_atomically(
    tmp_path: Path, manifest: WeightManifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = random_tensors(SPECS)
    write_weights(tmp_path, dataclasses.replace(manifest, version=1), tensors)
    real_replace = os.replace

    def crash_on_marker(src: str, dst: str) -> None:
        if Path(dst).name == "LATEST":
            raise OSError("crash before the rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_marker)
    with pytest.raises(OSError, match="crash before the rename"):
        write_weights(tmp_path, dataclasses.replace(manifest, version=2), tensors)
    assert latest_version(tmp_path) == 1  # readers still see the complete old version
    assert json.loads((tmp_path / "LATEST").read_text()) == {"version": 1}
    got: dict[str, torch.Tensor] = {}
    read_weights(tmp_path, dataclasses.replace(manifest, version=1), _collect(got))
    assert weights_checksum(got.items()) == weights_checksum(tensors.items())


@pytest.mark.parametrize(("method", "length"), [("fingerprint", 67), ("sha256", 64)])
def test_checksum_is_order_free_and_sensitive_to_every_field(method: Method, length: int) -> None:
    tensors = random_tensors(SPECS)
    base = weights_checksum(tensors.items(), method=method)

    def of(named: dict[str, torch.Tensor]) -> str:
        return weights_checksum(named.items(), method=method)

    assert base == weights_checksum(reversed(list(tensors.items())), method=method)
    assert base == weights_checksum(tensors.items(), method=method, threads=1)
    strided = tensors["q"].t().contiguous().t()  # same values, non-contiguous: hashed by content
    assert not strided.is_contiguous() and base == of({**tensors, "q": strided})
    assert len(base) == length and checksum_method(base) == method
    flipped = dict(tensors)
    flipped["embed"] = tensors["embed"].clone()
    flipped["embed"].view(torch.int16).view(-1)[3] ^= 1  # one bit of one bfloat16
    assert of(flipped) != base
    assert of({**tensors, "q": tensors["q"].reshape(4, 16)}) != base
    assert of({**tensors, "q": tensors["q"].view(torch.int16)}) != base
    renamed = {("Q" if n == "q" else n): t for n, t in tensors.items()}
    assert of(renamed) != base
    with pytest.raises(ValueError, match=r"^q: appears twice"):
        weights_checksum([("q", tensors["q"]), ("q", tensors["q"])], method=method)
    with pytest.raises(ValueError, match=r"^method: 'md5'"):
        weights_checksum(tensors.items(), method="md5")  # type: ignore[arg-type]


def test_group_of_one_reports_its_port_and_refuses_use_after_close() -> None:
    assert 0 < free_port() < 65536
    with pytest.raises(ValueError, match=r"^rank: 2 is outside \[0, 2\)"):
        WeightBroadcastGroup("127.0.0.1", 0, 2, 2)
    with pytest.raises(ValueError, match=r"^backend: 'mpi'"):
        WeightBroadcastGroup("127.0.0.1", 0, 0, 1, backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^chunk_bytes: 1000 is not a positive multiple of 256"):
        WeightBroadcastGroup("127.0.0.1", 0, 0, 1, chunk_bytes=1000)  # chunks are fingerprinted as they land
    group = WeightBroadcastGroup("127.0.0.1", 0, 0, 1, "solo", timeout_s=5.0)
    assert group.port > 0 and group.chunk_bytes == 16 << 20
    tensor = torch.arange(4)
    group.broadcast(tensor)
    assert group.all_ok(True) and not group.all_ok(False)
    group.close()
    with pytest.raises(WeightSyncError, match="'solo' is broken or closed"):
        group.broadcast(tensor)


@pytest.mark.parametrize(("size_mib", "tensors"), [(64, 1000), (1024, 1000), (16, 100)])
def test_model_specs_are_transformer_shaped_and_sized(size_mib: int, tensors: int) -> None:
    specs = model_specs(size_mib, tensors)
    total = sum(nbytes_of(shape, dtype) for _, shape, dtype in specs)
    assert len(specs) >= tensors
    assert abs(total - size_mib * 2**20) < 0.01 * size_mib * 2**20
    names = [name for name, _, _ in specs]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert "model.layers.0.self_attn.k_proj.bias" in names and "model.layers.0.mlp.down_proj.weight" in names
    assert {dtype for _, _, dtype in specs} == {torch.bfloat16, torch.float32}


def test_arena_adopts_live_parameters_without_changing_their_values(manifest: WeightManifest) -> None:
    params = random_tensors(SPECS)
    before = weights_checksum(params.items())
    arena = WeightArena.adopt(manifest, params)
    assert weights_checksum(params.items()) == before
    for name, view in arena.views():  # every parameter now *is* its view: writes to the arena reach it
        assert params[name].data_ptr() == view.data_ptr()
    arena.buckets[manifest.tensors[0].bucket].zero_()
    assert not params[manifest.tensors[0].name].any()
    assert arena.fits(manifest.with_header(version=99)) and not arena.fits(build_manifest(SPECS[:3], version=7))
    with pytest.raises(ValueError, match="bias: in the manifest but not expected"):
        WeightArena.adopt(manifest, {k: v for k, v in params.items() if k != "bias"})


def test_arena_point_swaps_parameters_between_two_arenas(manifest: WeightManifest) -> None:
    params, incoming = random_tensors(SPECS, seed=1), random_tensors(SPECS, seed=2)
    live, spare = WeightArena.adopt(manifest, params), WeightArena(manifest)
    spare.load(incoming.items())
    spare.point(params)
    assert weights_checksum(params.items()) == weights_checksum(incoming.items())
    assert all(params[name].data_ptr() == view.data_ptr() for name, view in spare.views())
    assert live.nbytes == spare.nbytes == sum(b.nbytes for b in manifest.buckets)
    with pytest.raises(ValueError, match="nope: not in"):
        spare.load([("nope", torch.zeros(1))])


def test_compact_manifest_resolves_from_the_layout_cache_only(manifest: WeightManifest) -> None:
    cache = LayoutCache(capacity=1)
    with pytest.raises(UnknownLayout):
        cache.resolve(manifest.to_proto(compact=True))
    assert cache.resolve(manifest.to_proto()) == manifest
    update = manifest.with_header(version=8, checksum="abc")
    wire = update.to_proto(compact=True)
    assert not wire.tensors and not wire.buckets and wire.layout_id == manifest.layout_id
    resolved = cache.resolve(wire)
    assert (resolved.version, resolved.checksum, resolved.tensors) == (8, "abc", manifest.tensors)
    other = build_manifest(SPECS[:3], version=1)
    cache.resolve(other.to_proto())  # capacity 1: the first layout is forgotten
    with pytest.raises(UnknownLayout):
        cache.resolve(wire)
    lying = other.to_proto()
    lying.layout_id = manifest.layout_id
    with pytest.raises(ValueError, match="layout_id"):
        cache.resolve(lying)


def test_manifest_builder_reuses_the_layout_until_the_specs_change() -> None:
    builder = ManifestBuilder(bucket_bytes=512)
    first, second = builder.build(SPECS, version=1), builder.build(SPECS, version=2, checksum="c")
    assert first.tensors is second.tensors and (second.version, second.checksum) == (2, "c")
    assert second.layout_id == first.layout_id == build_manifest(SPECS, version=5, bucket_bytes=512).layout_id
    changed = builder.build([*SPECS[:-1], ("k", (4, 9), torch.bfloat16)], version=3)
    assert changed.layout_id != first.layout_id


class CallFailed(grpc.RpcError):
    """A failed UpdateWeights call, as grpc reports one (``code``, ``details``)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Socket closed"


class CallFuture(Future):
    """A call's future as grpc's behaves once cancelled: ``result`` raises grpc.FutureCancelledError."""

    def result(self, timeout: float | None = None) -> object:
        try:
            return super().result(timeout)
        except CancelledError:
            raise grpc.FutureCancelledError() from None


def test_a_failed_call_ends_the_send_once_and_releases_the_calls_still_out() -> None:
    """A receiver that died mid-broadcast fails its call at once, while rank 0's send and a live receiver may wait for
    bytes that will not come: ``_answers`` calls ``on_failure`` once (the publisher closes the group: the send ends),
    also when no other call is out, and cancels the calls still out (their servers then close their groups), each
    answered with why; with no failure it is not called."""
    from relayrl.trainer.sync import WeightPublisher
    from relayrl.v1 import rollout_pb2

    publisher = SimpleNamespace(_probe_s=30.0, _unreachable=lambda workers: {})  # no probe period ends here

    def answers(outcomes: dict[str, object], closes: list[str]) -> dict:
        calls = {wid: CallFuture() for wid in outcomes}
        for wid, outcome in outcomes.items():
            if isinstance(outcome, Exception):
                calls[wid].set_exception(outcome)
            elif outcome != "blocked":
                calls[wid].set_result(outcome)
        return WeightPublisher._answers(publisher, calls, dict.fromkeys(outcomes, "addr"), lambda: closes.append("c"))

    closes: list[str] = []
    got = answers({"dead": CallFailed(), "live": "blocked"}, closes)
    assert got["dead"] == "UNAVAILABLE: Socket closed" and closes == ["c"]
    assert got["live"] == "released: dead failed during this update (UNAVAILABLE: Socket closed)"
    closes.clear()
    loaded = rollout_pb2.UpdateWeightsResponse(policy_version=1)
    assert answers({"a": loaded, "b": loaded}, closes) == {"a": loaded, "b": loaded} and closes == []
    assert answers({"only": CallFailed()}, closes) == {"only": "UNAVAILABLE: Socket closed"} and closes == ["c"]
