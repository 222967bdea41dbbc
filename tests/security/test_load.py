"""Reliability under load: ``relayrl bench load`` starts its own controller and worker, drives concurrent
clients and reports its JSON (the 64-client, 60-second acceptance run is documented, not repeated here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relayrl.bench.load import percentile

pytestmark = pytest.mark.slow


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([], 50) == 0.0 and percentile([3.0], 99) == 3.0


def test_bench_load_serves_every_request(tmp_path) -> None:
    argv = ["--clients", "8", "--duration", "2", "--warmup", "0.5", "--workers", "1", "--workdir", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "bench", "load", *argv], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["requests"] > 0 and report["errors"] == 0 and report["errors_by_code"] == {}
    assert 0 < report["latency_p50_s"] <= report["latency_p99_s"] <= report["latency_max_s"]
    assert report["controller_rss_mib_before"] > 0 and report["controller_rss_mib_after"] > 0
