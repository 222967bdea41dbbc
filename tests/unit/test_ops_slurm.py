"""relayrl.ops.slurm without Slurm: which extra rollout steps a scale starts or stops, and argument checks."""

from __future__ import annotations

import argparse
import json

import pytest

from relayrl.ops import commands, slurm
from relayrl.ops.parser import add_operator_commands


def test_scale_up_starts_the_lowest_free_indices_after_the_jobs_own_workers():
    assert slurm.plan(3, 2, []).start == [2]
    assert slurm.plan(5, 2, [3]).start == [2, 4]
    assert slurm.plan(2, 2, []) == slurm.Plan()


def test_scale_down_stops_the_highest_extra_workers_first():
    assert slurm.plan(3, 2, [2, 4, 3]).stop == [4, 3]
    assert slurm.plan(2, 2, [2]).stop == [2]


def test_the_jobs_own_step_is_never_scaled_below():
    with pytest.raises(ValueError, match="scale to 2 or more"):
        slurm.plan(1, 2, [])


def test_ports_in_use_come_from_the_role_files(tmp_path):
    (tmp_path / "roles").mkdir()
    for name, node, address in [("0", "n1", "h:50052"), ("1", "n1", "h:50053"), ("scale-2", "n2", "h:50054")]:
        rec = {"role": "rollout", "slurmd_nodename": node, "address": address}
        (tmp_path / "roles" / f"rollout.{name}.json").write_text(json.dumps(rec))
    job = slurm.SlurmJob("7", ["7", "8"], tmp_path, {"controller": "h:1"}, ["n1", "n2"], 2)
    assert slurm.ports_in_use(job) == {"n1": {50052, 50053}, "n2": {50054}}
    (tmp_path / "roles" / "rollout.1.json").unlink()  # a worker of the job's own step not started yet
    with pytest.raises(slurm.SlurmError, match="1 of its 2 rollout workers started"):
        slurm.ports_in_use(job)
    (tmp_path / "roles" / "rollout.1.json").write_text('{"role": "rollout", "addr')  # damaged, never half-written
    with pytest.raises(slurm.SlurmError, match=r"rollout\.1\.json: unreadable worker record"):
        slurm.ports_in_use(job)  # skipped, its port 50053 could be handed to a new worker


def test_slurm_job_and_kubernetes_flags_exclude_each_other(capsys):
    parser = argparse.ArgumentParser()
    add_operator_commands(parser.add_subparsers(dest="command"))
    argv = ["scale", "rollout", "3", "--slurm-job", "7", "--k8s-namespace", "ns", "--statefulset", "s"]
    args = parser.parse_args(argv)
    assert args.slurm_job == "7" and args.slurm_run_dir is None
    assert commands.cmd_scale_rollout(args) == 2
    assert "exclude each other" in capsys.readouterr().err
