"""retain_freed_memory: memory freed by one step is reused by the next without faulting pages in again."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# A fresh process (nothing else allocates): 4 rounds of ten SIZE blocks malloc'ed, written, freed, like a
# step's activations; prints whether the settings applied and each round's minor page faults.
ROUNDS = """
import ctypes, json, resource, sys
from relayrl.runtime.heap import retain_freed_memory
applied = retain_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, faults = int(sys.argv[1]), []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(10)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""
SMALL, LARGE = 8 << 20, 48 << 20  # below glibc's largest mmap threshold (32 MiB), and above it


def rounds(opt_out: bool, size: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RELAYRL_KEEP_FREED_MEMORY"}
    if opt_out:
        env["RELAYRL_KEEP_FREED_MEMORY"] = "0"
    argv = [sys.executable, "-c", ROUNDS, str(size)]
    return json.loads(subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout)


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["8MiB", "48MiB"])
def test_freed_blocks_are_reused_without_page_faults(size: int):
    pages = 10 * size // 4096  # pages one round touches
    tuned = rounds(opt_out=False, size=size)
    assert tuned["applied"]
    assert tuned["faults"][0] >= pages // 2  # the first round maps its pages
    assert max(tuned["faults"][1:]) < pages // 100, tuned  # later rounds reuse them


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["8MiB", "48MiB"])
def test_glibc_defaults_fault_every_round_and_the_opt_out_keeps_them(size: int):
    default = rounds(opt_out=True, size=size)
    assert not default["applied"]
    # the heap's free top is trimmed back to the kernel, a mapped block unmapped: each round faults its pages again
    assert min(default["faults"][1:]) >= 10 * size // 4096 // 2, default
