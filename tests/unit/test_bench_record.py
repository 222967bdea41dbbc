"""The benches' fairness record (relayrl/bench/record.py): the git state of the code that ran, and each side's
resolved precision and attention read from the lines the roles really log; and `relayrl bench trainer` on a tiny
model, whose JSON carries the record and tolerances relative to what they bound."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

from relayrl.bench import trainer as trainer_bench
from relayrl.bench.record import git_state, run_sides
from relayrl.config import TrainerConfig
from relayrl.rollout.hf import HFEngine
from relayrl.runtime.precision import compute_dtype
from relayrl.trainer.backends.fsdp import load_trained_model
from relayrl.trainer.precision import FLOAT32_SDPA, Precision


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_the_git_state_names_the_commit_and_a_dirty_tree_but_not_bench_results(tmp_path: Path) -> None:
    assert git_state(tmp_path) == {"commit": None, "dirty": None, "dirty_paths": []}  # not a checkout
    git(tmp_path, "init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    for path in ("code.py", "bench/results/x.json"):
        (tmp_path / path).write_text("1\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    state = git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["dirty"] is False
    (tmp_path / "bench" / "results" / "x.json").write_text("")  # `> bench/results/x.json` before the bench runs
    (tmp_path / "untracked.txt").write_text("scratch")
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("2\n")
    assert git_state(tmp_path) | {"commit": None} == {"commit": None, "dirty": True, "dirty_paths": ["code.py"]}


def test_each_side_is_read_from_the_lines_the_roles_log(tmp_path: Path, tiny_model_dir: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    root = logging.getLogger("relayrl")
    level = root.level
    root.setLevel(logging.INFO)
    for role, load in [
        ("trainer", lambda: trained(tiny_model_dir, tmp_path)),
        ("rollout-0", lambda: HFEngine(str(tiny_model_dir), dtype="bfloat16", attn_implementation="eager")),
    ]:
        handler = logging.FileHandler(logs / f"{role}.log")
        root.addHandler(handler)
        try:
            load()
        finally:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    compute, why = compute_dtype("auto", "cpu")
    name = str(compute).removeprefix("torch.")
    attention = FLOAT32_SDPA if compute == torch.bfloat16 else "sdpa"
    assert run_sides(logs) == {
        "trainer": {"precision": f"{name} ({why})", "attn_implementation": attention},
        "rollout-0": {"precision": "bfloat16", "attn_implementation": "eager"},
    }


def trained(model_dir: Path, tmp_path: Path) -> None:
    """What a trainer rank logs as it loads (trainer.precision auto, model.attn_implementation auto)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        precision = Precision.resolve(TrainerConfig(), "auto", torch.device("cpu"))
        load_trained_model(str(model_dir), precision, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_bench_trainer_records_the_machine_and_relative_tolerances(tiny_model_dir: Path, capsys) -> None:
    argv = ["--model", str(tiny_model_dir), "--prompts", "2", "--n", "2", "--prompt-tokens", "6"]
    assert trainer_bench.main([*argv, "--response-tokens", "4", "--rounds", "1", "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    machine = result["machine"]
    assert machine["cpu_model"] and machine["cpu_flags"] and len(machine["git"]["commit"]) == 40
    resolved = machine["resolved"]
    assert list(resolved) == list(trainer_bench.MODES)
    assert resolved["float32"] == {"precision": "float32", "attn_implementation": "sdpa"}
    assert resolved["bfloat16"] == {"precision": "bfloat16", "attn_implementation": FLOAT32_SDPA}
    assert set(result["tolerance"]) == {"loss_rel", "grad_norm_rel", "entropy_rel"}
    assert 0.1 < result["loss_scale"] < 2  # the token mean of |GRPO advantage| (normalised by the group's std)
    gaps = result["relative_gaps_vs_float32_full_logits"]
    assert gaps["float32"] == {"loss_rel": 0.0, "grad_norm_rel": 0.0, "entropy_rel": 0.0}
    assert result["within_tolerance"]["float32"] is True
    assert all(set(g) == set(result["tolerance"]) for g in gaps.values())
