"""One thread of a worker process runs torch's multi-threaded (intra-op) regions: the engine's scheduler.

torch's CPU build runs its parallel kernels on GNU OpenMP (libgomp), which gives every native thread that
enters a parallel region a team of its own and keeps it for the thread's life. Once the teams of a process
hold more threads than it has cores, libgomp throttles every idle team thread to ~100 spins before it sleeps
on a futex (``gomp_throttled_spin_count_var`` in libgomp's env.c, used while ``gomp_managed_threads`` >
``gomp_available_cpus``): then each of a decode step's small kernels pays a wake-up. A rollout worker that
receives weights on a gRPC thread gets a second team at its first update, and from then on every decode step
pays those wake-ups. ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` cannot lift the
throttle (it is capped at 100-1000 spins whatever they say), so the worker keeps to one team: the scheduler
thread takes the configured count and every other thread (weight loads, checksums, request handling) one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def start_intra_op_owner(target: Callable[[], None], threads: int, name: str) -> threading.Thread:
    """Start ``target`` on a daemon thread whose torch ops use ``threads`` intra-op threads; returns it once that
    count is fixed. From then on every other thread of the process runs its torch ops on one thread (torch's
    process-wide count is set to 1; the calling thread's own count too)."""
    pinned, released = threading.Event(), threading.Event()

    def run() -> None:
        torch.set_num_threads(threads)
        torch.get_num_threads()  # a thread takes torch's process-wide count once, when it first asks: now
        pinned.set()
        released.wait()  # no torch work here while the process-wide count changes
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    pinned.wait()
    torch.set_num_threads(1)
    released.set()
    return thread
