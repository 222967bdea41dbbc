"""One training step of the Megatron backend at TP=2, at PP=2 and at DP=2 equals the 2-rank FSDP step on the same
batch and weights, and the weights rollout workers receive after it are the Megatron HF export, bit for
bit, and FSDP's export to float rounding (real torchrun, 2 gloo ranks; see megatron_parity.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("megatron_parity.py")


def test_megatron_tp2_pp2_dp2_step_equals_fsdp(tmp_path, tiny_model_dir):
    out = tmp_path / "parity.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    done = subprocess.run([*argv, str(tiny_model_dir), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    fsdp = results["fsdp"]
    for label in ("tp2", "pp2", "dp2"):
        mine = results[label]
        for key in ("loss", "entropy", "ref_kl", "ppo_kl", "clip_frac"):
            assert abs(mine[key] - fsdp[key]) <= 1e-5, (label, key, mine, fsdp)
        assert abs(mine["grad_norm"] - fsdp["grad_norm"]) <= 1e-5 * max(1.0, fsdp["grad_norm"]), (label, mine, fsdp)
        assert mine["max_abs_diff"] <= 1e-5, (label, mine)
        assert mine["names"], label
        assert mine["received_checksum"] == mine["export_checksum"], label
