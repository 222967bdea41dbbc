"""glibc malloc settings for a process that allocates and frees the same large tensors every step.

PyTorch's CPU tensors come from plain malloc/free. glibc serves a block above its mmap threshold (128 KiB,
raised as blocks are freed, to at most 32 MiB) with a fresh ``mmap`` that ``free`` unmaps, and it trims the
heap's free top once it exceeds 2 x that threshold. Either way the next step's activations land on pages the
kernel must fault in and zero, 4 KiB at a time, every step; a model's largest tensors (an output head's logits
chunk, a [vocab, hidden] gradient, the gradients set to None at each step) are all above 32 MiB. A page fault
is dearer in a virtual machine (the host may fault the page in too). ``retain_freed_memory`` sets

    M_MMAP_MAX       = 0        no block is mmapped: every one comes from the heap and is reused
    M_MMAP_THRESHOLD = 32 MiB   moot under M_MMAP_MAX = 0; the fallback should a libc refuse that one
    M_TRIM_THRESHOLD = 2 GiB    freed memory stays mapped (the largest value mallopt's int takes)
    M_TOP_PAD        = 256 MiB  the heap grows in large steps

which is what a caching allocator (CUDA's, or jemalloc/tcmalloc preloaded) gives: faults only the first time
a size is reached. That holds for the main thread's arena (grown by ``sbrk``), where torch's CPU ops allocate
their outputs; a block above 64 MiB asked for by another thread is still mapped (glibc's ``sysmalloc``: a thread
arena's heaps hold at most 64 MiB each). The cost: resident memory does not shrink after a peak.

``RELAYRL_KEEP_FREED_MEMORY=0`` leaves glibc's defaults; so does any libc but glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

OPT_OUT_ENV = "RELAYRL_KEEP_FREED_MEMORY"
# malloc.h
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 256 << 20))


def retain_freed_memory() -> bool:
    """Apply ``SETTINGS`` with glibc's ``mallopt`` (module docstring); returns whether they were applied."""
    if os.environ.get(OPT_OUT_ENV) == "0" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = all([mallopt(param, value) == 1 for param, value in SETTINGS])  # each tried, whatever the others do
    if not applied:
        log.warning("glibc mallopt refused a setting; freed tensors may be unmapped and faulted in again")
    return applied
