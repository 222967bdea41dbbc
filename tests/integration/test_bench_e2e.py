"""``relayrl bench e2e --quick`` through the CLI: relayrl (``relayrl up``) and TRL both run every workload,
the responses are equally long where the workload asks for it, and the JSON carries every figure."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.bench.e2e import split_cpus

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("trl") is None, reason="trl is not installed (the baseline): pip install -e '.[bench]'"
    ),
]

RUN_KEYS = ("s_per_step", "samples_per_s", "tokens_per_s", "generation_s", "reward_curve", "target", "samples_total")


@pytest.mark.timeout(1800)
def test_quick_bench_runs_both_systems_on_every_workload(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "relayrl.cli", "bench", "e2e", "--quick", "--json", "--workdir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1500, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["machine"]["cpus"] >= 1 and result["machine"]["versions"]["trl"]
    heavy, demo = result["workloads"]["gen-heavy"], result["workloads"]["demo"]
    k1 = ["relayrl-k1", "relayrl-k1-rollout"]
    split = ["relayrl-k0-split", "relayrl-k1-rollout-split"] if len(os.sched_getaffinity(0)) >= 2 else []
    assert [r["system"] for r in heavy["runs"]] == ["relayrl-k0-stream", "relayrl-k0-whole", *k1, *split, "trl"]
    assert [r["system"] for r in demo["runs"]] == ["relayrl-default", "trl"]
    for row in heavy["runs"] + demo["runs"]:
        assert "error" not in row, row
        assert all(key in row for key in RUN_KEYS) and row["s_per_step"] > 0 and row["samples_per_s"] > 0
        assert len(row["reward_curve"]) == row["steps"]
    for row in heavy["runs"]:  # every response exactly max_tokens long, in both systems
        assert row["equal_work_held"] and row["response_len_mean"] == heavy["settings"]["max_tokens"]
        assert row["train_s"] is not None
    trl_demo = demo["runs"][1]
    assert trl_demo["samples_total"] >= demo["runs"][0]["samples_total"]  # TRL gets relayrl's sample budget
    for wl in (heavy, demo):
        assert wl["systems"]["trl"]["rounds_ok"] == 1
        assert all(ratios["samples_per_s"] > 0 for ratios in wl["relayrl_vs_trl"].values())
    variants = ["relayrl-k0-stream", "relayrl-k0-whole", *k1, *split]
    assert set(heavy["relayrl_vs_trl"]) == {f"{variant}/trl" for variant in variants}
    assert all(r["step_speedup"] > 0 for r in heavy["relayrl_vs_trl"].values())  # same samples per step
    assert set(heavy["overlap"]) == {"relayrl-k1-rollout", *split[1:]}
    assert all(entry["step_vs_phases_alone"] > 0 for entry in heavy["overlap"].values())
    if split:  # relayrl up pinned each role of the split runs to its half (the roles log it at start)
        trainer_cpus, rollout_cpus = split_cpus(sorted(os.sched_getaffinity(0)))
        for variant in split:
            logs = tmp_path / "runs" / f"gen-heavy-{variant}-r1" / "logs"
            assert f"trainer pinned to CPUs {trainer_cpus}" in (logs / "trainer.log").read_text()
            assert f"rollout pinned to CPUs {rollout_cpus}" in (logs / "rollout-0.log").read_text()
