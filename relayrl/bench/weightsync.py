"""``relayrl bench weightsync``: packed double-buffered weight sync vs its limit and its baselines.

For every (model size, receiver count) the receivers run as separate OS processes (forked from
multiprocessing's fork server, which imported torch and this module once: none of it is timed) holding a
model-shaped set of parameters; the sender (this process) plays trainer rank 0. Methods, each timed
end to end from the sender, the median of ``--repeat`` runs, and verified by checksum:

- ``packed``: relayrl's transfer: the manifest over a control message (receivers resolve + validate
  it and answer; after the first update it travels compact, naming its layout by id) and, while it
  is in flight, ``WeightSender.send`` from the sender's ``WeightArena`` (where the trainer gathers its weights each
  step: the gather is the pack) while the receivers run ``receive_into``: their parameters live in
  an arena too (adopted on the first update, as the hf engine does), so the bytes land in place.
  Ends in a collective vote. No verification (``weight_sync.verify: off``).
- ``verified``: ``packed`` with the full fingerprint (``verify: fingerprint``): sender and receivers fold
  the fingerprint of every chunk as it passes, the sender's follows the buckets in band, every receiver
  compares and the vote carries it; each receiver answers with its fingerprint, checked against the
  sender's.
- ``sampled``: ``verified`` as relayrl runs by default (``verify: sampled``): the same, folding one 256-byte
  block in ``--sample-stride`` (the phase drawn from the update's version, as the trainer does).
- ``sha256``: ``packed`` verified the way relayrl did before the fingerprint: sha256 of the sender's arena
  before the send, of every receiver's weights after it, compared by the receiver.
- ``copying``: relayrl's other path, a copy at each end: the sender packs from separate tensors into
  two staging buffers (double-buffered, chunk-pipelined), the receivers take it the way vLLM / SGLang
  workers must: ``receive_weights`` into two staging buffers, each view copied into its parameter.
- ``raw``: the limit: one broadcast of one flat buffer of the same bytes on the same group (+ the vote).
- ``per_tensor``: what TRL / OpenRLHF do: per tensor a control round trip to every receiver (name,
  dtype, shape; each acknowledges), then one broadcast of that tensor, which the receiver allocates,
  receives and copies into its parameter.
- ``adapter``: a LoRA run's per-step update at the same model size (``--lora-rank``, on q/k/v/o: the default
  ``model.lora``): the adapter's tensors alone, under PEFT's names, from the sender's adapter arena, verified as
  relayrl verifies by default (``sampled``); the receivers take them as a rollout worker does, into staging
  copies (``receive_weights``). ``adapter_over_sampled`` (seconds of an adapter update / seconds of the same
  run's full ``sampled`` update) and ``adapter_bytes_share`` (adapter bytes / full bytes) compare the two.
- ``disk``: the filesystem fallback: ``write_weights`` by the sender, then ``read_weights`` by every
  receiver at once (the files were just written, so reads mostly come from the page cache).

Control messages are unary gRPC calls by default (``--control grpc``: what a relayrl-native design
would use; TRL uses HTTP, OpenRLHF Ray calls, both slower) or, with ``--control socket``, frames on a
kept-open TCP connection: the cheapest real round trip there is, the per-tensor baseline's best case.
Either way the packed path pays the same per message, once per update.

``per_tensor_vs_raw`` is the ceiling of any speed-up over per-tensor on the link measured: even the
raw single-buffer broadcast is only that much faster than per-tensor. ``verified_over_raw`` (seconds of
a verified update / seconds of the raw broadcast) is what verification leaves of the transfer's speed;
``sampled_over_raw`` the same for the default. Verification alone is timed in the sender, per GiB:
``fingerprint_s_per_gib`` and ``sampled_s_per_gib`` (folding the arena's chunks, as the sender does during
a send), ``sha256_s_per_gib`` (``weights_checksum(..., method="sha256")``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import multiprocessing as mp
import os
import queue
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from relayrl.bench.record import machine_record
from relayrl.config import WeightSyncConfig
from relayrl.ops.args import OneLineParser, existing_dir
from relayrl.v1 import common_pb2 as pb
from relayrl.weightsync import (
    BufferPair,
    LayoutCache,
    ManifestBuilder,
    WeightArena,
    WeightBroadcastGroup,
    WeightManifest,
    WeightSender,
    checksum_method,
    read_weights,
    receive_into,
    receive_weights,
    weights_checksum,
    write_weights,
)
from relayrl.weightsync.fingerprint import Fingerprinter, phase_for
from relayrl.weightsync.manifest import Spec, dtype_from_name, dtype_name, nbytes_of
from relayrl.weightsync.packing import transfer_chunks
from relayrl.wire.lora import LoraAdapterSpec

MIB = 1 << 20
PER_LAYER = 12  # q/k/v/o weights, q/k/v biases, gate/up/down, two norms
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # model.lora's default target_modules


# ---------------------------------------------------------------- the model


def model_specs(size_mib: int, n_tensors: int = 1000) -> list[Spec]:
    """A Qwen2-like decoder of ~``size_mib`` MiB and >= ``n_tensors`` tensors (12 per layer + 3).

    bf16 matrices and biases, fp32 norms; GQA with kv = h/4, mlp = 3h. The hidden size h (a multiple
    of 16) gives the layers ~80 % of the bytes; the vocabulary of the untied embedding and lm_head
    takes the rest.
    """
    layers = max(1, math.ceil((n_tensors - 3) / PER_LAYER))
    budget = size_mib * MIB
    h = max(16, int(math.sqrt(0.8 * budget / (layers * 2 * 11.5))) // 16 * 16)
    kv, ffn = h // 4, 3 * h
    bf16, f32 = torch.bfloat16, torch.float32
    layer: list[tuple[str, tuple[int, ...], torch.dtype]] = [
        ("self_attn.q_proj.weight", (h, h), bf16),
        ("self_attn.q_proj.bias", (h,), bf16),
        ("self_attn.k_proj.weight", (kv, h), bf16),
        ("self_attn.k_proj.bias", (kv,), bf16),
        ("self_attn.v_proj.weight", (kv, h), bf16),
        ("self_attn.v_proj.bias", (kv,), bf16),
        ("self_attn.o_proj.weight", (h, h), bf16),
        ("mlp.gate_proj.weight", (ffn, h), bf16),
        ("mlp.up_proj.weight", (ffn, h), bf16),
        ("mlp.down_proj.weight", (h, ffn), bf16),
        ("input_layernorm.weight", (h,), f32),
        ("post_attention_layernorm.weight", (h,), f32),
    ]
    layer_bytes = sum(nbytes_of(shape, dtype) for _, shape, dtype in layer)
    vocab = max(16, (budget - layers * layer_bytes - 4 * h) // (2 * 2 * h))
    specs: list[Spec] = [("model.embed_tokens.weight", (vocab, h), bf16)]
    for i in range(layers):
        specs += [(f"model.layers.{i}.{name}", shape, dtype) for name, shape, dtype in layer]
    specs += [("model.norm.weight", (h,), f32), ("lm_head.weight", (vocab, h), bf16)]
    return specs


def adapter_specs(specs: Sequence[Spec], rank: int) -> list[Spec]:
    """The rank-``rank`` LoRA adapter of ``specs``' LORA_TARGETS weights under PEFT's saved names: A [rank, in],
    B [out, rank] in the weight's dtype."""
    out: list[Spec] = []
    for name, shape, dtype in specs:
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in LORA_TARGETS and len(shape) == 2:
            prefix = f"base_model.model.{module}"
            out += [
                (f"{prefix}.lora_A.weight", (rank, shape[1]), dtype),
                (f"{prefix}.lora_B.weight", (shape[0], rank), dtype),
            ]
    return out


def random_tensors(specs: Sequence[Spec], seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded values for ``specs``: normal for floating dtypes, uniform in [0, 2**31) for integer ones."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, dtype=dtype, generator=gen)
        if dtype.is_floating_point
        else torch.randint(0, 2**31, shape, dtype=dtype, generator=gen)
        for name, shape, dtype in specs
    }


def _specs_to_json(specs: Sequence[Spec]) -> list[list[Any]]:
    return [[name, list(shape), dtype_name(dtype)] for name, shape, dtype in specs]


def _specs_from_json(rows: list[list[Any]]) -> list[Spec]:
    return [(name, tuple(shape), dtype_from_name(dtype)) for name, shape, dtype in rows]


def _rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


# ---------------------------------------------------------------- control plane
#
# Every control message is a request (JSON header + raw payload) answered by one JSON reply. Two
# transports: "grpc" (a unary call, as relayrl's own control plane would make it) and "socket"
# (length-prefixed frames on a kept-open TCP connection: the cheapest real round trip there is).
# The bootstrap (receivers announcing their rank and gRPC port) always uses the socket.

CONTROL_METHOD = "/relayrl.bench.WeightSyncBench/Call"


def _encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("!II", len(head), len(payload)) + head + payload


def _decode(frame: bytes) -> tuple[dict[str, Any], bytes]:
    head_len, _ = struct.unpack_from("!II", frame)
    return json.loads(frame[8 : 8 + head_len]), frame[8 + head_len :]


class Channel:
    """Length-prefixed frames over TCP: !II (header length, payload length), JSON header, raw payload."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        self.sock.sendall(_encode(header, payload))

    def recv(self) -> tuple[dict[str, Any], bytes]:
        head_len, payload_len = struct.unpack("!II", self._exactly(8))
        return json.loads(self._exactly(head_len)), self._exactly(payload_len)

    def _exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("control channel closed by the peer")
            got += k
        return bytes(buf)


Reply = Callable[[dict[str, Any]], None]
Request = tuple[dict[str, Any], bytes, Reply]


def _socket_requests(chan: Channel) -> Iterator[Request]:
    while True:
        header, payload = chan.recv()
        yield header, payload, chan.send


def _grpc_requests(timeout_s: float) -> tuple[grpc.Server, int, Iterator[Request]]:
    """A gRPC server whose unary handler hands each request to the receiver's main thread and
    answers with whatever the main thread replies (the main thread may go on working after that)."""
    inbox: queue.Queue[Request] = queue.Queue()

    def call(request: bytes, _context: grpc.ServicerContext) -> bytes:
        answered = threading.Event()
        box: list[dict[str, Any]] = []

        def reply(header: dict[str, Any]) -> None:
            box.append(header)
            answered.set()

        header, payload = _decode(request)
        inbox.put((header, payload, reply))
        answered.wait(timeout_s)
        return json.dumps(box[0] if box else {"ok": False, "error": "no reply"}).encode()

    service, method = CONTROL_METHOD.strip("/").split("/")
    handler = grpc.method_handlers_generic_handler(service, {method: grpc.unary_unary_rpc_method_handler(call)})
    server = grpc.server(ThreadPoolExecutor(max_workers=4), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, iter(inbox.get, None)


class _SocketControl:
    def __init__(self, chan: Channel, timeout_s: float) -> None:
        self.chan = chan
        chan.sock.settimeout(timeout_s)

    def start(self, header: dict[str, Any], payload: bytes) -> None:
        self.chan.send(header, payload)

    def result(self) -> dict[str, Any]:
        return self.chan.recv()[0]


class _GrpcControl:
    def __init__(self, port: int, timeout_s: float) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = self.channel.unary_unary(CONTROL_METHOD)
        self.timeout_s = timeout_s
        self.future: grpc.Future | None = None

    def start(self, header: dict[str, Any], payload: bytes) -> None:
        self.future = self.stub.future(_encode(header, payload), timeout=self.timeout_s)

    def result(self) -> dict[str, Any]:
        return json.loads(self.future.result())


# ---------------------------------------------------------------- receiver process


class _Receiver:
    """A rollout-worker stand-in: holds parameters, obeys control requests (``on_<op>``), answering
    each exactly once through ``self.reply``, possibly before it has finished its work."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.reply: Reply = lambda header: None
        self.params: dict[str, torch.Tensor] = {}
        self.specs: list[Spec] = []
        self.buffers = BufferPair("cpu")
        self.arena: WeightArena | None = None
        self.layouts = LayoutCache()
        self.raw: torch.Tensor | None = None
        self.adapter: dict[str, torch.Tensor] = {}
        self.group: WeightBroadcastGroup | None = None
        self.last: dict[str, dict[str, Any]] = {}

    def load(self, views: list[tuple[str, torch.Tensor]]) -> None:
        """What an engine does with received tensors: copy each into its parameter, in place."""
        for name, view in views:
            self.params[name].copy_(view)

    def on_join(self, h: dict[str, Any], _: bytes) -> None:
        self.group = WeightBroadcastGroup(
            "127.0.0.1", h["port"], self.rank, h["world_size"], h["group_name"], timeout_s=h["timeout_s"]
        )
        self.reply({"ok": True})

    def on_model(self, h: dict[str, Any], _: bytes) -> None:
        self.params, self.buffers, self.arena, self.raw = {}, BufferPair("cpu"), None, None
        self.layouts = LayoutCache()
        self.specs = _specs_from_json(h["specs"])
        self.params = {name: torch.zeros(shape, dtype=dtype) for name, shape, dtype in self.specs}
        self.reply({"ok": True})

    def on_zero(self, _h: dict[str, Any], _: bytes) -> None:
        for t in self.params.values():
            t.zero_()
        self.reply({"ok": True})

    def on_checksum(self, h: dict[str, Any], _: bytes) -> None:
        of = {"params": self.params, "adapter": self.adapter}
        checksum = _sha256(self.raw) if h["of"] == "raw" else weights_checksum(of[h["of"]].items())
        self.reply({"ok": True, "checksum": checksum})

    def on_packed(self, h: dict[str, Any], payload: bytes) -> None:
        """Received in place, then checked as the rollout worker checks (``verify`` / ``checksum``)."""
        manifest = self._manifest(payload)
        rss_before, adopt_extra = _rss_bytes(), 0
        if self.arena is None or not self.arena.fits(manifest):  # first update: move params in, a bucket at a time
            self.arena = WeightArena.adopt(manifest, self.params)
            adopt_extra = max(b.nbytes for b in manifest.buckets)
        stats = receive_into(self.group, manifest, self.arena)
        checksum = stats.checksum
        if manifest.checksum:
            checksum = weights_checksum(self.params.items(), method=checksum_method(manifest.checksum))
            if checksum != manifest.checksum:
                raise ValueError(f"checksum: {checksum[:12]} != manifest {manifest.checksum[:12]}")
        self._remember(h["op"], stats.peak_extra_bytes + adopt_extra, rss_before, checksum)

    def on_copying(self, _h: dict[str, Any], payload: bytes) -> None:
        manifest = self._manifest(payload)
        rss_before = _rss_bytes()
        stats = receive_weights(self.group, manifest, self.load, device="cpu", buffers=self.buffers)
        self._remember("copying", stats.peak_extra_bytes, rss_before)

    def on_adapter(self, _h: dict[str, Any], payload: bytes) -> None:
        """An adapter update as the rollout worker takes it: into staging copies (RolloutWorker._update_adapter)."""
        manifest = self.layouts.resolve(pb.WeightManifest.FromString(payload))
        rss_before, received = _rss_bytes(), {}
        stats = receive_weights(
            self.group, manifest, lambda views: received.update((n, t.clone()) for n, t in views), buffers=self.buffers
        )
        self.adapter = received
        self._remember("adapter", stats.peak_extra_bytes, rss_before, stats.checksum)

    def _manifest(self, payload: bytes) -> WeightManifest:
        manifest = self.layouts.resolve(pb.WeightManifest.FromString(payload))
        manifest.validate_against(self.specs)
        return manifest

    def _remember(self, method: str, peak_extra: int, rss_before: int, checksum: str = "") -> None:
        """Answer once the update is in (as UpdateWeights does), keeping its memory figures for ``stats``."""
        self.last[method] = {"peak_extra": peak_extra, "rss_growth": _rss_bytes() - rss_before}
        self.reply({"ok": True, "checksum": checksum})

    def on_stats(self, h: dict[str, Any], _: bytes) -> None:
        self.reply({"ok": True, **self.last[h["of"]]})

    def on_raw(self, h: dict[str, Any], _: bytes) -> None:
        if self.raw is None or self.raw.numel() != h["nbytes"]:
            self.raw = None
            self.raw = torch.empty(h["nbytes"], dtype=torch.uint8)
        self.reply({"ok": True})
        self.group.broadcast(self.raw)
        self.group.all_ok(True)

    def on_tensor(self, h: dict[str, Any], _: bytes) -> None:
        self.reply({"ok": True})
        tensor = torch.empty(h["shape"], dtype=dtype_from_name(h["dtype"]))
        self.group.broadcast(tensor)
        self.params[h["name"]].copy_(tensor)

    def on_sync(self, _h: dict[str, Any], _: bytes) -> None:
        self.reply({"ok": True})

    def on_disk(self, h: dict[str, Any], payload: bytes) -> None:
        manifest = WeightManifest.from_proto(pb.WeightManifest.FromString(payload))
        read_weights(h["root"], manifest, self.load)
        self.reply({"ok": True})


def receiver_main(rank: int, bootstrap_port: int, control: str, timeout_s: float) -> None:
    """Entry point of a forked receiver: announce itself on the sender's bootstrap socket, then serve
    control requests over ``control`` ("socket" or "grpc") until "stop"."""
    torch.set_num_threads(1)
    chan = Channel(socket.create_connection(("127.0.0.1", bootstrap_port)))
    if control == "grpc":
        server, port, requests = _grpc_requests(timeout_s)
        chan.send({"rank": rank, "grpc_port": port})
    else:
        chan.send({"rank": rank})
        requests = _socket_requests(chan)
    receiver = _Receiver(rank)
    for header, payload, reply in requests:
        receiver.reply = reply
        if header["op"] == "stop":
            reply({"ok": True})
            break
        try:
            getattr(receiver, f"on_{header['op']}")(header, payload)
        except Exception as exc:
            reply({"ok": False, "error": f"receiver {rank}: {type(exc).__name__}: {exc}"})
            raise
    if control == "grpc":
        server.stop(grace=1)


# ---------------------------------------------------------------- sender side


class _Fleet:
    """The receiver processes (group ranks 1..n) and a control stub for each, in rank order."""

    def __init__(self, n: int, control: str, timeout_s: float) -> None:
        self.control = control
        ctx = mp.get_context("forkserver")  # a fresh interpreter per receiver imported torch again: seconds each
        ctx.set_forkserver_preload(["torch", __name__])  # read when the server starts (once per process)
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(timeout_s)
        port = listener.getsockname()[1]
        self.procs = [
            ctx.Process(target=receiver_main, args=(r, port, control, timeout_s), daemon=True) for r in range(1, n + 1)
        ]
        for proc in self.procs:
            proc.start()
        hellos: dict[int, tuple[Channel, dict[str, Any]]] = {}
        with listener:
            while len(hellos) < n:
                chan = Channel(listener.accept()[0])
                hello = chan.recv()[0]
                hellos[hello["rank"]] = (chan, hello)
        self.controls: list[_SocketControl | _GrpcControl] = [
            _GrpcControl(hello["grpc_port"], timeout_s) if control == "grpc" else _SocketControl(chan, timeout_s)
            for chan, hello in (hellos[r] for r in range(1, n + 1))
        ]

    def call(self, header: dict[str, Any], payload: bytes = b"") -> list[dict[str, Any]]:
        """Send one request to every receiver at once, then wait for every reply (RuntimeError with
        the first failure's message)."""
        self.start(header, payload)
        return self.results()

    def start(self, header: dict[str, Any], payload: bytes = b"") -> None:
        """Send one request to every receiver at once; ``results`` collects the replies."""
        for control in self.controls:
            control.start(header, payload)

    def results(self) -> list[dict[str, Any]]:
        replies = [control.result() for control in self.controls]
        for reply in replies:
            if not reply.get("ok"):
                raise RuntimeError(reply.get("error", "receiver failed"))
        return replies

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call({"op": "stop"})
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


@dataclass
class _Cell:
    """Everything one (size, receivers) measurement needs on the sender."""

    fleet: _Fleet
    group: WeightBroadcastGroup
    specs: list[Spec]
    tensors: dict[str, torch.Tensor]
    manifest: WeightManifest
    arena: WeightArena  # the trainer's gathered weights, in the manifest's layout
    builder: ManifestBuilder
    sender: WeightSender
    tmp_dir: str
    sample_stride: int
    adapter: WeightArena  # a LoRA run's adapter at this model size (the ``adapter`` method)
    lora: LoraAdapterSpec
    version: int = 0
    layout_sent: bool = False  # receivers hold the layout: later manifests travel compact
    adapter_sent: bool = False  # the same for the adapter's layout


def _run_packed(cell: _Cell, method: str) -> dict[str, Any]:
    """Manifest built, serialised and sent to every receiver, and the send started at once (as the
    trainer's UpdateWeights calls are in flight while it broadcasts); done when every receiver has
    answered. "packed" / "verified" / "sampled" / "sha256": from the sender's arena into the receivers'
    arenas, with no check, the in-band fingerprint (full or sampled), or sha256 at both ends (timed);
    "copying": packed from the tensors
    and received through staging buffers. A verified update's ``agreed``: every receiver answered with
    the sender's checksum."""
    cell.version += 1
    start = time.perf_counter()
    checksum = weights_checksum(cell.arena.views(), method="sha256") if method == "sha256" else ""
    verify = {"verified": "fingerprint", "sampled": "sampled", "sha256": ""}.get(method, "off")
    stride = cell.sample_stride if verify == "sampled" else 0
    manifest = cell.builder.build(
        cell.specs,
        version=cell.version,
        checksum=checksum,
        verify=verify,
        sample_stride=stride,
        sample_phase=phase_for(cell.version, stride) if stride else 0,
    )
    op = "copying" if method == "copying" else "packed"
    cell.fleet.start({"op": op}, manifest.to_proto(compact=cell.layout_sent).SerializeToString())
    cell.layout_sent = True
    sent = cell.sender.send(cell.group, manifest, cell.tensors if method == "copying" else cell.arena)
    answers = cell.fleet.results()
    seconds = time.perf_counter() - start
    replies = cell.fleet.call({"op": "stats", "of": op})
    expected = checksum or sent.checksum
    return {
        "seconds": seconds,
        "peak_extra": max(r["peak_extra"] for r in replies),
        "rss_growth": max(r["rss_growth"] for r in replies),
        "agreed": all(a["checksum"] == expected for a in answers),
    }


def _run_adapter(cell: _Cell) -> dict[str, Any]:
    """A LoRA step's update: the adapter manifest (kind "adapter", verify sampled) and the adapter arena's send;
    done when every receiver has answered with the sender's fingerprint (``agreed``)."""
    cell.version += 1
    start = time.perf_counter()
    stride = cell.sample_stride
    manifest = cell.adapter.manifest.with_header(
        version=cell.version,
        verify="sampled",
        sample_stride=stride,
        sample_phase=phase_for(cell.version, stride),
        kind="adapter",
        lora=cell.lora,
    )
    cell.fleet.start({"op": "adapter"}, manifest.to_proto(compact=cell.adapter_sent).SerializeToString())
    cell.adapter_sent = True
    sent = cell.sender.send(cell.group, manifest, cell.adapter)
    answers = cell.fleet.results()
    return {"seconds": time.perf_counter() - start, "agreed": all(a["checksum"] == sent.checksum for a in answers)}


def _run_raw(cell: _Cell, flat: torch.Tensor) -> dict[str, Any]:
    cell.fleet.call({"op": "raw", "nbytes": flat.numel()})
    start = time.perf_counter()
    cell.group.broadcast(flat)
    cell.group.all_ok(True)
    return {"seconds": time.perf_counter() - start}


def _run_per_tensor(cell: _Cell) -> dict[str, Any]:
    start = time.perf_counter()
    for name, shape, dtype in cell.specs:
        cell.fleet.call({"op": "tensor", "name": name, "shape": list(shape), "dtype": dtype_name(dtype)})
        cell.group.broadcast(cell.tensors[name])
    cell.fleet.call({"op": "sync"})
    return {"seconds": time.perf_counter() - start}


def _run_disk(cell: _Cell) -> dict[str, Any]:
    cell.version += 1
    start = time.perf_counter()
    manifest = cell.builder.build(cell.specs, version=cell.version)
    write_weights(cell.tmp_dir, manifest, cell.tensors, keep=1)
    cell.fleet.call({"op": "disk", "root": cell.tmp_dir}, manifest.to_proto().SerializeToString())
    return {"seconds": time.perf_counter() - start}


def _measure_cell(cell: _Cell, repeat: int, log: Callable[[str], None]) -> dict[str, Any]:
    """One untimed warm-up round (allocates and first-touches every buffer), then ``repeat`` timed
    rounds running the four methods in turn, so drift hits all alike; the median is reported. In the
    last round every method starts from zeroed receiver parameters and ends in a checksum on every
    receiver (raw: of its flat buffer)."""
    flat = torch.randint(0, 256, (cell.manifest.total_bytes,), dtype=torch.uint8)
    expected = {
        "params": weights_checksum(cell.tensors.items()),
        "raw": _sha256(flat),
        "adapter": weights_checksum(cell.adapter.views()),
    }
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "packed": lambda: _run_packed(cell, "packed"),
        "verified": lambda: _run_packed(cell, "verified"),
        "sampled": lambda: _run_packed(cell, "sampled"),
        "sha256": lambda: _run_packed(cell, "sha256"),
        "copying": lambda: _run_packed(cell, "copying"),
        "raw": lambda: _run_raw(cell, flat),
        "per_tensor": lambda: _run_per_tensor(cell),
        "disk": lambda: _run_disk(cell),
        "adapter": lambda: _run_adapter(cell),
    }
    runs: dict[str, list[dict[str, Any]]] = {method: [] for method in runners}
    verified: dict[str, bool] = {}
    for round_index in range(repeat + 1):
        last = round_index == repeat
        for method, run in runners.items():
            if last:
                cell.fleet.call({"op": "zero"})
            runs[method].append(run())
            if last:
                kind = method if method in ("raw", "adapter") else "params"
                replies = cell.fleet.call({"op": "checksum", "of": kind})
                verified[method] = all(r["checksum"] == expected[kind] for r in replies)
                verified[method] &= runs[method][-1].get("agreed", True)
        timed = ", ".join(f"{m} {runs[m][-1]['seconds']:.3f}" for m in runners)
        log(f"    {'warm-up' if round_index == 0 else f'round {round_index}'}: {timed} s")
    log(f"    verified: {verified}")
    return _row(cell, runs, verified) | _time_verification(cell, repeat)


def _time_verification(cell: _Cell, repeat: int) -> dict[str, float]:
    """Seconds per GiB of verification alone on the sender, median of ``repeat`` (+1 warm-up): the
    fingerprint, full and sampled, folded over the arena's chunks (what a send does along the way), sha256
    of its tensors."""

    def fold(manifest: WeightManifest) -> None:
        fingerprinter = Fingerprinter(manifest, cell.group.chunk_bytes, "cpu")
        for bucket, flat in zip(manifest.buckets, cell.arena.buckets, strict=True):
            for chunk in transfer_chunks(manifest, bucket, cell.group.chunk_bytes):
                fingerprinter.add(bucket.index, chunk.start, flat[chunk.start : chunk.end])
        fingerprinter.digest()

    stride = cell.sample_stride
    sampled = cell.manifest.with_header(version=1, verify="sampled", sample_stride=stride, sample_phase=stride // 2)

    def sha256() -> None:
        weights_checksum(cell.arena.views(), method="sha256")

    gib = cell.manifest.total_bytes / (1 << 30)
    row = {}
    for name, run in (
        ("fingerprint", lambda: fold(cell.manifest)),
        ("sampled", lambda: fold(sampled)),
        ("sha256", sha256),
    ):
        times = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        row[f"{name}_s_per_gib"] = round(statistics.median(times[1:]) / gib, 4)
    return row


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(t.numpy())).hexdigest()


def _row(cell: _Cell, runs: dict[str, list[dict[str, Any]]], verified: dict[str, bool]) -> dict[str, Any]:
    """Medians of the timed rounds (runs[m][1:]); receiver memory from the warm-up runs, the ones that
    adopted the arena and first touched the staging buffers."""
    nbytes = cell.manifest.total_bytes
    seconds = {m: statistics.median(r["seconds"] for r in timed[1:]) for m, timed in runs.items()}
    row: dict[str, Any] = {
        "size_mib": round(nbytes / MIB, 1),
        "tensors": len(cell.specs),
        "buckets": len(cell.manifest.buckets),
        "receivers": len(cell.fleet.controls),
        "control": cell.fleet.control,
    }
    row |= {f"{m}_s": round(s, 4) for m, s in seconds.items()}
    moved = {m: cell.adapter.manifest.total_bytes if m == "adapter" else nbytes for m in seconds}
    row |= {f"{m}_gbps": round(moved[m] / s / 1e9, 3) for m, s in seconds.items()}
    row |= {
        "packed_vs_raw": round(seconds["raw"] / seconds["packed"], 3),
        "verified_over_raw": round(seconds["verified"] / seconds["raw"], 3),
        "sampled_over_raw": round(seconds["sampled"] / seconds["raw"], 3),
        "sample_stride": cell.sample_stride,
        "sha256_over_raw": round(seconds["sha256"] / seconds["raw"], 3),
        "copying_vs_raw": round(seconds["raw"] / seconds["copying"], 3),
        "speedup_vs_per_tensor": round(seconds["per_tensor"] / seconds["packed"], 2),
        "per_tensor_vs_raw": round(seconds["per_tensor"] / seconds["raw"], 2),
        "speedup_vs_disk": round(seconds["disk"] / seconds["packed"], 2),
        "receiver_peak_extra_mib": round(runs["packed"][0]["peak_extra"] / MIB, 1),
        "receiver_rss_growth_mib": round(runs["packed"][0]["rss_growth"] / MIB, 1),
        "copying_peak_extra_mib": round(runs["copying"][0]["peak_extra"] / MIB, 1),
        "copying_rss_growth_mib": round(runs["copying"][0]["rss_growth"] / MIB, 1),
        "adapter_mib": round(cell.adapter.manifest.total_bytes / MIB, 2),
        "lora_rank": cell.lora.rank,
        "adapter_bytes_share": round(cell.adapter.manifest.total_bytes / nbytes, 4),
        "adapter_over_sampled": round(seconds["adapter"] / seconds["sampled"], 3),
        "verified": all(verified.values()),
    }
    return row


def run_grid(args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """One fleet (and one broadcast group) per receiver count; every size measured on it."""
    rows = []
    for n_receivers in args.receivers:
        log(f"starting {n_receivers} receiver(s)")
        with contextlib.ExitStack() as stack:
            fleet = _Fleet(n_receivers, args.control, args.timeout_s)
            stack.callback(fleet.close)
            group = WeightBroadcastGroup(
                "127.0.0.1", 0, 0, n_receivers + 1, f"bench-{n_receivers}", "gloo", args.timeout_s
            )
            stack.callback(group.close)
            fleet.call(
                {
                    "op": "join",
                    "port": group.port,
                    "world_size": n_receivers + 1,
                    "group_name": group.group_name,
                    "timeout_s": args.timeout_s,
                }
            )
            for size in args.sizes:
                specs = model_specs(size, args.tensors)
                log(f"  {size} MiB, {len(specs)} tensors, {n_receivers} receiver(s)")
                fleet.call({"op": "model", "specs": _specs_to_json(specs)})
                with tempfile.TemporaryDirectory(prefix="relayrl-bench-ws-", dir=args.tmp_dir) as tmp_dir:
                    tensors = random_tensors(specs, seed=size)
                    builder = ManifestBuilder(bucket_bytes=args.bucket_mib * MIB)
                    manifest = builder.build(specs, version=0)
                    arena = WeightArena(manifest)
                    arena.load(tensors.items())  # the trainer's per-step gather writes here (untimed)
                    lora = adapter_specs(specs, args.lora_rank)
                    adapter = WeightArena(ManifestBuilder(bucket_bytes=args.bucket_mib * MIB).build(lora, version=0))
                    adapter.load(random_tensors(lora, seed=size + 1).items())
                    cell = _Cell(
                        fleet=fleet,
                        group=group,
                        specs=specs,
                        tensors=tensors,
                        manifest=manifest,
                        arena=arena,
                        builder=builder,
                        sender=WeightSender("cpu"),
                        tmp_dir=tmp_dir,
                        sample_stride=args.sample_stride,
                        adapter=adapter,
                        lora=LoraAdapterSpec(args.lora_rank, 2.0 * args.lora_rank, LORA_TARGETS),
                    )
                    rows.append(_measure_cell(cell, args.repeat, log))
    return rows


COLUMNS = [
    ("size_mib", "MiB", "{:.0f}"),
    ("tensors", "tensors", "{}"),
    ("receivers", "recv", "{}"),
    ("packed_s", "packed s", "{:.3f}"),
    ("verified_s", "verified s", "{:.3f}"),
    ("sampled_s", "sampled s", "{:.3f}"),
    ("sha256_s", "sha256 s", "{:.3f}"),
    ("copying_s", "copying s", "{:.3f}"),
    ("raw_s", "raw s", "{:.3f}"),
    ("per_tensor_s", "per-tensor s", "{:.3f}"),
    ("disk_s", "disk s", "{:.3f}"),
    ("packed_gbps", "packed GB/s", "{:.2f}"),
    ("raw_gbps", "raw GB/s", "{:.2f}"),
    ("packed_vs_raw", "packed/raw", "{:.2f}"),
    ("verified_over_raw", "verified s/raw s", "{:.2f}"),
    ("sampled_over_raw", "sampled s/raw s", "{:.2f}"),
    ("sha256_over_raw", "sha256 s/raw s", "{:.2f}"),
    ("fingerprint_s_per_gib", "fp s/GiB", "{:.3f}"),
    ("sampled_s_per_gib", "sampled s/GiB", "{:.4f}"),
    ("sha256_s_per_gib", "sha256 s/GiB", "{:.3f}"),
    ("copying_vs_raw", "copying/raw", "{:.2f}"),
    ("speedup_vs_per_tensor", "x per-tensor", "{:.1f}"),
    ("per_tensor_vs_raw", "ceiling", "{:.1f}"),
    ("speedup_vs_disk", "x disk", "{:.1f}"),
    ("receiver_peak_extra_mib", "extra MiB", "{:.0f}"),
    ("copying_peak_extra_mib", "copying extra MiB", "{:.0f}"),
    ("adapter_s", "adapter s", "{:.4f}"),
    ("adapter_over_sampled", "adapter s/sampled s", "{:.3f}"),
    ("verified", "ok", "{}"),
]


def format_table(rows: list[dict[str, Any]]) -> str:
    cells = [[title for _, title, _ in COLUMNS]]
    cells += [[fmt.format(row[key]) for key, _, fmt in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="relayrl bench weightsync", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON list of rows to stdout")
    parser.add_argument("--sizes", type=_ints, default=[64, 256, 1024], help="model sizes in MiB")
    parser.add_argument("--receivers", type=_ints, default=[1, 2, 3], help="receiver counts")
    parser.add_argument("--tensors", type=int, default=1000, help="at least this many tensors")
    parser.add_argument("--bucket-mib", type=int, default=512, help="bucket size of the packed path")
    parser.add_argument("--repeat", type=int, default=5, help="runs per method; the median is reported")
    parser.add_argument(
        "--control", choices=["grpc", "socket"], default="grpc", help="transport of the control messages"
    )
    parser.add_argument("--timeout-s", type=float, default=120.0, help="collective / control timeout")
    parser.add_argument(
        "--tmp-dir", type=existing_dir, default=None, help="where the disk method writes (default: system tmp)"
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="rank of the adapter method's LoRA (q/k/v/o)")
    parser.add_argument(
        "--sample-stride",
        type=int,
        default=WeightSyncConfig().sample_stride,
        help="weight_sync.sample_stride of the sampled method (a power of two)",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.tensors < 1 or args.bucket_mib < 1 or not args.sizes or not args.receivers:
        parser.error("--repeat, --tensors, --bucket-mib, --sizes and --receivers must be positive")
    if args.lora_rank < 1:
        parser.error("--lora-rank must be positive")
    if args.sample_stride < 1 or args.sample_stride & (args.sample_stride - 1):
        parser.error("--sample-stride must be a power of two")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the grid; 0 if every method delivered bit-identical weights everywhere, else 1."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # like the receivers: on few cores, intra-op threads slow small copies down
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {message}", file=sys.stderr, flush=True)

    machine = machine_record(None)  # bytes move here: no model computes
    rows = [row | {"machine": machine} for row in run_grid(args, log)]
    log("done")
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0 if all(row["verified"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
