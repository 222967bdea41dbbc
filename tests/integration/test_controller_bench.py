"""``relayrl bench controller`` end to end at a tiny size: a real controller, simulated workers in two processes,
the simulated trainer; checks what the JSON reports (the 1,000-worker, 100,000-trajectory run is `make
bench-controller`; timings are not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_controller_reports_every_field(tmp_path) -> None:
    argv = ["--workers", "6", "--simulators", "2", "--trajectories", "200", "--n", "4", "--batch-groups", "4"]
    argv += ["--gen-batch", "8", "--dispatch-chunk", "2", "--idle-s", "0.5", "--json", "--workdir", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "bench", "controller", *argv], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    print(json.dumps(report))  # shown when an assertion fails
    assert report["workers"] == report["registered_workers"] == 6
    assert report["trajectories"] >= 200 and report["trajectories"] % 4 == 0  # whole groups of n = 4
    assert report["trajectories_trained"] == report["steps"] * 4 * 4  # every step: batch-groups x n
    assert report["response_tokens_mean"] == report["response_tokens"] == 16  # the canned responses, whole
    assert report["trajectories_per_second"] > 0 and report["bare_trajectories_per_second"] > 0
    assert report["controller_vs_bare"] > 0 and report["vs_target"] > 0
    assert report["generate_calls"] >= report["trajectories"] / (2 * 4)  # chunks of 2 prompts x 4 samples
    assert 0 < report["dispatch_latency_p50_ms"] <= report["dispatch_latency_p99_ms"]
    assert 0 < report["controller_rss_mib_start"] <= report["controller_rss_mib_peak"]
    assert report["controller_cpu_seconds"] > 0 and report["controller_cpu_us_per_trajectory"] > 0
    # an idle controller (heartbeats, stats polls of 6 workers) takes well under a core; the net cost of a
    # trajectory (its CPU less the idle share over the run) is at most the gross one (max(0, .): never below 0)
    assert report["controller_idle_cpu_share"] < 1.0
    assert report["controller_cpu_us_per_trajectory_net"] <= report["controller_cpu_us_per_trajectory"]
    ledger = report["ledger"]
    assert ledger["failed"] == 0 and ledger["trained"] >= report["steps"] * 4  # nothing lost, nothing failed
    assert report["machine"]["cpu_flags"] and report["machine"]["resolved"] is None  # simulated: no model computes
