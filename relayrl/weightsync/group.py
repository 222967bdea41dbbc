"""A broadcast group for weights, separate from any ``torch.distributed`` world group.

The idea of vLLM's ``StatelessProcessGroup``: rank 0 (the trainer) hosts its own ``TCPStore``, the
receivers (rollout workers) connect to it, and the c10d backend (``ProcessGroupGloo`` or
``ProcessGroupNCCL``) is constructed directly on ``PrefixStore(group_name, store)``: no
``init_process_group``, no global state, any number of groups per process.

Construction never blocks: gloo is built with a lazy-init device and NCCL creates its communicator
at the first collective, so rank 0 can bind port 0, read ``port`` and advertise it before any
receiver exists; the rendezvous happens in the first collective (``barrier`` forces it).

Every wait is bounded by ``timeout_s``. A failed or timed-out collective closes the group: the caller
drops it and forms a new one (a new ``group_name``) without the dead peer. ``close`` from another thread
ends every wait on the group at once. It cannot rely on the backend for that with gloo: ProcessGroupGloo
keeps Backend's no-op ``abort`` (torch 2.13, torch/csrc/distributed/c10d/ProcessGroupGloo.hpp), so a
thread inside ``Work.wait`` stays there until the operation's timeout, and its connections close only
when it is destroyed, whose destructor joins its threads once its queued operations have run. So a
gloo wait is on the operation's future or the group's closing, whichever comes first, and a closed
gloo backend is kept, with its operations still out, by a drain thread until they end: dropping it
never blocks whoever held the last reference. NCCL's ``abort`` does abort its communicator.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import threading
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from relayrl.weightsync.errors import WeightSyncError, WeightSyncTimeout
from relayrl.weightsync.manifest import ALIGN

Backend = Literal["gloo", "nccl"]

# Transfer chunk per backend (one collective each): small enough that packing / loading a chunk
# overlaps the transfer of its neighbours, large enough that per-collective latency stays ~1 %.
# gloo: chosen on loopback with `relayrl bench weightsync`; nccl: a guess, not measured yet (packing
# is a device memcpy there, and NVLink needs large messages to reach full bandwidth).
CHUNK_BYTES: dict[str, int] = {"gloo": 16 << 20, "nccl": 256 << 20}
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def _is_loopback(address: str) -> bool:
    try:
        return address == "localhost" or ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _gloo_backend(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, master_address: str
) -> dist.ProcessGroupGloo:
    """ProcessGroupGloo on a lazy-init device: loopback when the master is local, else
    GLOO_SOCKET_IFNAME or the host's default interface."""
    pg_gloo = dist.ProcessGroupGloo
    if _is_loopback(master_address):
        device = pg_gloo.create_device(hostname="127.0.0.1", lazy_init=True)
    elif os.environ.get("GLOO_SOCKET_IFNAME"):
        device = pg_gloo.create_device(interface=os.environ["GLOO_SOCKET_IFNAME"], lazy_init=True)
    else:
        device = pg_gloo.create_default_device(lazy_init=True)
    options = pg_gloo._Options()
    options._timeout = timeout
    options._devices = [device]
    return pg_gloo(store, rank, world_size, options)


def _nccl_backend(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, device: torch.device
) -> dist.Backend:
    """ProcessGroupNCCL bound to ``device`` (not testable on this CPU-only build).

    A dead rollout worker must not take the trainer down: the watchdog's own timeout is set well above
    ours so that our bounded wait + ``abort()`` handles a hang first, and the group is built with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator, keep the process; the default 3 ends
    the process on an error the watchdog sees first). The variable is read in the constructor.
    """
    from torch.distributed import ProcessGroupNCCL  # only present in CUDA builds

    torch.cuda.set_device(device)
    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = 2 * timeout + datetime.timedelta(seconds=60)
    previous = os.environ.get(NCCL_ERROR_HANDLING)
    os.environ[NCCL_ERROR_HANDLING] = "2"
    try:
        return ProcessGroupNCCL(store, rank, world_size, options)
    finally:
        if previous is None:
            del os.environ[NCCL_ERROR_HANDLING]
        else:
            os.environ[NCCL_ERROR_HANDLING] = previous


def _classify(context: str, exc: RuntimeError) -> WeightSyncError:
    """WeightSyncTimeout when c10d / gloo says it timed out, WeightSyncError otherwise.

    Seen in torch 2.13: "Operation timed out!" (Work.wait), "Timed out waiting ...ms for recv
    operation" and "Application timeout caused pair closure" (gloo's own timeout), "Connection reset /
    closed by peer" (a peer died: an error, not a timeout).
    """
    text = str(exc).lower()
    message = f"{context}: {str(exc).splitlines()[0]}"
    return WeightSyncTimeout(message) if "timed out" in text or "timeout" in text else WeightSyncError(message)


_PRUNE_EVERY = 64


def _let_go(pg: dist.Backend, backend: Backend, works: list[dist.Work]) -> None:
    """Release a closed group's backend: NCCL's ``abort`` fails its pending work; gloo's is kept by a daemon
    thread until ``works`` (its operations still out, each bounded by the group's timeout) end."""
    if backend == "nccl":
        pg.abort()
        return
    out = [work for work in works if not work.is_completed()]
    if out:
        threading.Thread(target=_drain, args=(pg, out), name="weight-group-drain", daemon=True).start()


def _drain(pg: dist.Backend, works: list[dist.Work]) -> None:
    """Wait out ``works``; ``pg`` is held until then (the thread drops the last references when it ends). Their
    outcomes are moot: the group was closed."""
    for work in works:
        with contextlib.suppress(RuntimeError):
            work.wait()


class WeightBroadcastGroup:
    """Rank 0 = trainer rank 0 (hosts the store); ranks 1..world_size-1 = receivers."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str = "relayrl-weights",
        backend: Backend = "gloo",
        timeout_s: float = 60.0,
        device: torch.device | str = "cpu",
        *,
        chunk_bytes: int | None = None,
    ) -> None:
        """``chunk_bytes`` (default: CHUNK_BYTES[backend]; a multiple of ALIGN, so that chunks can be
        fingerprinted as they land) must be the same on every member."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} is outside [0, {world_size})")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: {backend!r} is not 'gloo' or 'nccl'")
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.backend, self.timeout_s, self.device = backend, timeout_s, torch.device(device)
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES[backend]
        if self.chunk_bytes <= 0 or self.chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes: {self.chunk_bytes} is not a positive multiple of {ALIGN}")
        self.broken = False
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._lock = threading.Lock()
        self._waiters: set[threading.Event] = set()  # gloo waits in progress: close sets them
        self._works: list[dist.Work] = []  # operations that may still be out (finished ones pruned now and then)
        self._prune_at = _PRUNE_EVERY
        try:
            self._store = dist.TCPStore(
                master_address,
                master_port,
                world_size,
                is_master=rank == 0,
                timeout=self._timeout,
                wait_for_workers=False,
            )
        except RuntimeError as exc:  # DistNetworkError / DistStoreError: bind failed, master unreachable
            raise _classify(f"weight group {group_name!r} store {master_address}:{master_port}", exc) from exc
        self.port = int(self._store.port)  # the real port: what rank 0 advertises when it asked for 0
        prefixed = dist.PrefixStore(group_name, self._store)
        if backend == "gloo":
            self._pg = _gloo_backend(prefixed, rank, world_size, self._timeout, master_address)
        else:
            self._pg = _nccl_backend(prefixed, rank, world_size, self._timeout, self.device)

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start broadcasting ``tensor`` from rank ``src``; finish it with ``wait``."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        options.timeout = self._timeout
        return self._post(lambda pg: pg.broadcast([tensor], options))

    def wait(self, work: dist.Work) -> None:
        """Block until ``work`` completes; WeightSyncTimeout / WeightSyncError within ``timeout_s``, or at once
        when the group is closed meanwhile (by another thread)."""
        if self.backend == "gloo":
            self._await(work)
        try:
            work.wait(self._timeout)
        except RuntimeError as exc:
            raise self._fail(exc) from exc

    def _await(self, work: dist.Work) -> None:
        """Return once ``work`` is done (``wait`` then collects its outcome without blocking); WeightSyncError when
        the group is closed first, WeightSyncTimeout after ``timeout_s``."""
        done = threading.Event()
        with self._lock:
            if self.broken:
                raise self._closed()
            self._waiters.add(done)
        future = work.get_future()  # done just before the work counts as completed (gloo's finishWorkGloo)
        try:
            future.add_done_callback(lambda _future: done.set())
            done.wait(self.timeout_s)
        finally:
            with self._lock:
                self._waiters.discard(done)
        if future.done():
            return
        if self.broken:
            raise self._closed()
        raise self._fail(RuntimeError(f"Operation timed out after {self.timeout_s:g}s"))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Blocking broadcast of ``tensor`` (in place on receivers) from rank ``src``."""
        self.wait(self.broadcast_async(tensor, src))

    def all_ok(self, ok: bool) -> bool:
        """Collective vote: True iff every rank passed ok=True (an allreduce-MAX of failure flags)."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        options.timeout = self._timeout
        self.wait(self._post(lambda pg: pg.allreduce([flag], options)))
        return int(flag.item()) == 0

    def barrier(self) -> None:
        """Every rank has arrived (forces the rendezvous of a freshly built group)."""
        self.all_ok(True)

    def close(self) -> None:
        """Make the group unusable, from any thread and any number of times: every wait on it ends at once
        (WeightSyncError), the backend is let go (module docstring: NCCL aborted, gloo drained) and the store
        dropped."""
        with self._lock:
            pg, self._pg = self._pg, None
            works, self._works = self._works, []
            waiters, self._waiters = self._waiters, set()
            self.broken = True
        for waiter in waiters:
            waiter.set()
        if pg is not None:
            _let_go(pg, self.backend, works)
        self._store = None

    def _post(self, start: Callable[[dist.Backend], dist.Work]) -> dist.Work:
        """``start(backend)``'s collective, remembered until it is done (``close`` hands the ones still out to the
        drain); WeightSyncError when the group is broken or closed. A ``close`` on another thread while it is being
        posted (not holding the lock: NCCL's first collective may block, and only ``close`` aborts it) is caught
        after: the work was not among those ``close`` handed over, so it is let go here. Otherwise the caller's
        reference would be the gloo backend's last, and dropping it would run the destructor that waits out the
        work (module docstring) in the caller."""
        pg = self._pg
        if self.broken or pg is None:
            raise self._closed()
        try:
            work = start(pg)
        except RuntimeError as exc:
            raise self._fail(exc) from exc
        with self._lock:
            if not self.broken:
                self._works.append(work)
                if len(self._works) >= self._prune_at:  # amortised: the list at most doubles between prunes
                    self._works = [w for w in self._works if not w.is_completed()]
                    self._prune_at = 2 * len(self._works) + _PRUNE_EVERY
                return work
        if self.backend == "gloo":  # NCCL's close aborted the communicator, which fails this work too
            _let_go(pg, self.backend, [work])
        raise self._closed()

    def _closed(self) -> WeightSyncError:
        return WeightSyncError(f"weight group {self.group_name!r} is broken or closed; form a new one")

    def _fail(self, exc: RuntimeError) -> WeightSyncError:
        """Close the group and classify the error."""
        self.close()
        return _classify(f"weight group {self.group_name!r} rank {self.rank}", exc)

    def __enter__(self) -> WeightBroadcastGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
