"""``relayrl bench e2e --quick`` through the CLI: relayrl (``relayrl up``) and TRL both run both default workloads,
the responses are equally long where the workload asks for it, and the JSON carries every figure.

One K = 0 / K = 1 pair of gen-heavy's variants runs (``--variants``): the split pair where there are two cores (the
pinning and its overlap entry), else the unpinned one; every variant's config is checked to load in
tests/unit/test_bench_e2e.py, and each relayrl mode it sets is tested on its own (streaming, K = 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.bench.e2e import split_cpus

pytestmark = pytest.mark.slow  # trl (the baseline) is in the dev extra: missing, this fails, never skips

RUN_KEYS = ("s_per_step", "samples_per_s", "tokens_per_s", "generation_s", "reward_curve", "target", "samples_total")


@pytest.mark.timeout(1800)
def test_quick_bench_runs_both_systems_on_every_workload(tmp_path: Path) -> None:
    split = len(os.sched_getaffinity(0)) >= 2
    pair = ["relayrl-k0-split", "relayrl-k1-rollout-split"] if split else ["relayrl-k0-whole", "relayrl-k1-rollout"]
    variants = ",".join([*(name.removeprefix("relayrl-") for name in pair), "default"])
    argv = [sys.executable, "-m", "relayrl.cli", "bench", "e2e", "--quick", "--json", "--workdir", str(tmp_path)]
    argv += ["--variants", variants]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1500, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["machine"]["cpus"] >= 1 and result["machine"]["versions"]["trl"]
    heavy, demo = result["workloads"]["gen-heavy"], result["workloads"]["demo"]
    assert [r["system"] for r in heavy["runs"]] == [*pair, "trl"]
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
    assert set(heavy["relayrl_vs_trl"]) == {f"{variant}/trl" for variant in pair}
    assert all(r["step_speedup"] > 0 for r in heavy["relayrl_vs_trl"].values())  # same samples per step
    assert set(heavy["overlap"]) == {pair[1]} and heavy["overlap"][pair[1]]["phases_alone_from"] == pair[0]
    assert all(entry["step_vs_phases_alone"] > 0 for entry in heavy["overlap"].values())
    if split:  # relayrl up pinned each role of the split runs to its half (the roles log it at start)
        trainer_cpus, rollout_cpus = split_cpus(sorted(os.sched_getaffinity(0)))
        for variant in pair:
            logs = tmp_path / "runs" / f"gen-heavy-{variant}-r1" / "logs"
            assert f"trainer pinned to CPUs {trainer_cpus}" in (logs / "trainer.log").read_text()
            assert f"rollout pinned to CPUs {rollout_cpus}" in (logs / "rollout-0.log").read_text()
