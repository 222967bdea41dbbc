"""``relayrl bench weightsync`` end to end on a tiny grid: every method runs, is verified, and is reported."""

from __future__ import annotations

import json

import pytest

from relayrl.bench.weightsync import format_table, main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("control", ["grpc", "socket"])
def test_bench_runs_verifies_and_reports(control: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--sizes", "4", "--receivers", "2", "--tensors", "60", "--repeat", "1", "--control", control]
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["verified"] and row["receivers"] == 2 and row["tensors"] >= 60 and row["control"] == control
    for method in ("packed", "verified", "sampled", "sha256", "copying", "raw", "per_tensor", "disk", "adapter"):
        assert row[f"{method}_s"] > 0 and row[f"{method}_gbps"] > 0
    assert row["verified_over_raw"] > 0 and row["fingerprint_s_per_gib"] > 0 and row["sha256_s_per_gib"] > 0
    assert row["sampled_over_raw"] > 0 and row["sampled_s_per_gib"] > 0 and row["sample_stride"] == 64
    # in place: one bucket, once, to move the parameters into the arena; copying: two staging buckets
    assert 0 < row["receiver_peak_extra_mib"] <= 512 and 0 < row["copying_peak_extra_mib"] <= 2 * 512
    assert row["per_tensor_vs_raw"] > 0
    assert 0 < row["adapter_bytes_share"] < 1 and row["adapter_over_sampled"] > 0 and row["lora_rank"] == 8
    assert "packed/raw" in format_table([row])
