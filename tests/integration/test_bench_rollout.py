"""``relayrl bench rollout`` on a tiny grid: both modes run against a real worker process per decode runner, and
every logprob of rows batched across concurrent calls equals a plain forward's."""

from __future__ import annotations

import json

import pytest

from relayrl.bench.rollout import main

pytestmark = pytest.mark.slow


def test_bench_runs_both_modes_and_runners_with_exact_logprobs(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--prompts", "4", "--n", "3", "--calls", "2", "--max-tokens", "5", "--rounds", "1"]
    assert main([*argv, "--hidden", "32", "--layers", "2", "--workdir", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["runner_chosen"] == {"auto": "fast", "transformers": "transformers"}
    for decode in ("auto", "transformers"):
        assert set(result["seconds"][decode]) == {"serialized", "concurrent"}
        assert all(len(v) == 1 and v[0] > 0 for v in result["seconds"][decode].values())
        assert result["speedup_concurrent_vs_serialized"][decode] > 0
        assert result["tokens_per_second"][decode]["concurrent"] > 0
        assert result["logprob_parity_max"][decode] < 1e-5
    assert result["speedup_vs_transformers"]["transformers"] == {"serialized": 1.0, "concurrent": 1.0}
    assert result["speedup_vs_transformers"]["auto"]["concurrent"] > 0
    assert result["median_worker_cpu_seconds"]["auto"]["concurrent"] > 0
    assert result["cpu_speedup_vs_transformers"]["auto"]["concurrent"] > 0
    side = {"precision": "float32", "attn_implementation": "sdpa"}  # the bench's float32 weights, the model's SDPA
    assert result["machine"]["resolved"] == {"rollout-auto": side, "rollout-transformers": side}
    assert result["machine"]["cpu_model"] and len(result["machine"]["git"]["commit"]) == 40
