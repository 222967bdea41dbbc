"""relayrl.runtime.deadline: a worker in the middle of a call dies with the pool's process (it would otherwise run
its call to the end: a hung parse forever)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

POOL = """
import os, threading, time
from relayrl.runtime.deadline import DeadlinePool
from relayrl.runtime.procs import child_pids

pool = DeadlinePool(time.sleep, workers=1, timeout_s=120)
threading.Thread(target=pool, args=(120,), daemon=True).start()  # from a thread, as the controller's dispatch
while not child_pids(os.getpid()):
    time.sleep(0.1)
time.sleep(1.0)  # the worker is in its 120 s call
print(child_pids(os.getpid())[0], flush=True)
os._exit(0)
"""


def test_a_worker_in_a_call_dies_with_the_pools_process() -> None:
    done = subprocess.run([sys.executable, "-c", POOL], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    worker = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (reaped by init soon) is dead
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
