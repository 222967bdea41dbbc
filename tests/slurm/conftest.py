"""The local Slurm cluster of tests/slurm: one per session."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_slurm_hetjob import LOCAL_CLUSTER, Cluster, _install_skip_reason

from relayrl.runtime.ports import free_port


@pytest.fixture(scope="session")
def cluster():
    """The local three-node cluster, started once for every Slurm test (a start and a stop cost seconds each)."""
    reason = _install_skip_reason()
    if reason:
        pytest.skip(reason)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    res = subprocess.run(["bash", LOCAL_CLUSTER, "install"], capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, f"installing slurm-wlm/munge failed:\n{res.stderr[-3000:]}"
    timings["install_s"] = time.monotonic() - t0

    # Not pytest's tmp_path: it is mode 0700 under /tmp/pytest-of-root, which user munge cannot traverse.
    base = Path(tempfile.mkdtemp(prefix="relayrl-slurm-", dir="/tmp"))
    base.chmod(0o755)
    env = {
        **os.environ,
        "RELAYRL_SLURM_DIR": str(base),
        "RELAYRL_SLURM_PORT_BASE": str(free_port("0.0.0.0", count=4)),  # slurmctld's, then a slurmd's per node
        "RELAYRL_SLURM_NODES": "3",  # a het job's components share no node: a third group needs a third node
        "RELAYRL_SLURM_CPUS": str(max(4, os.cpu_count() or 1)),
        "SLURM_CONF": str(base / "etc" / "slurm.conf"),
    }
    for var in [v for v in env if v.startswith("SLURM_") and v != "SLURM_CONF"]:
        env.pop(var)  # never inherit an outer job's context
    t0 = time.monotonic()
    start = ["bash", LOCAL_CLUSTER, "start"]
    res = subprocess.run(start, env=env, capture_output=True, text=True, timeout=180)
    timings["start_s"] = time.monotonic() - t0
    try:
        assert res.returncode == 0, f"local cluster did not start:\n{res.stderr[-3000:]}"
        print(f"\nlocal slurm cluster under {base}: {timings}", file=sys.stderr)
        yield Cluster(base=base, env=env, timings=timings)
    finally:
        subprocess.run(["bash", LOCAL_CLUSTER, "stop", "--purge"], env=env, capture_output=True, timeout=120)
