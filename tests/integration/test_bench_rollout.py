"""``relayrl bench rollout`` on a tiny grid: both modes run against a real worker process, and every logprob of
rows batched across concurrent calls equals a plain forward's."""

from __future__ import annotations

import json

import pytest

from relayrl.bench.rollout import main

pytestmark = pytest.mark.slow


def test_bench_runs_both_modes_with_exact_logprobs(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--prompts", "4", "--n", "3", "--calls", "2", "--max-tokens", "5", "--rounds", "1"]
    assert main([*argv, "--hidden", "32", "--layers", "2", "--workdir", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["seconds"]) == {"serialized", "concurrent"}
    assert all(len(v) == 1 and v[0] > 0 for v in result["seconds"].values())
    assert result["speedup_concurrent_vs_serialized"] > 0
    assert result["tokens_per_second"]["concurrent"] > 0
    assert result["logprob_parity_max"] < 1e-3
