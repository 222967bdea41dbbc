"""``relayrl trainer launch``: one standalone rank runs without torchrun's agent, with the agent's environment;
SIGTERM still reaches it and its exit code comes back; anything more runs under torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.trainer.launch import single_rank_command

RANK_ARGS = ["-m", "relayrl.cli", "trainer", "run", "--config", "c.yaml"]

# The rank: forms its one-rank gloo world the way the trainer does (relayrl/trainer/world.py), reports what it
# saw, then exits with the code asked for, or waits for SIGTERM (the trainer's clean stop) and exits 0.
PROBE = """
import json, os, signal, sys, time
from relayrl.trainer.world import init_world
import torch.distributed as dist
init_world("gloo")
seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
seen.update(world=dist.get_world_size(), parent=os.getppid(), pid=os.getpid())
dist.destroy_process_group()
mode = sys.argv[1]
if mode == "wait":
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
print(json.dumps(seen), flush=True)
if mode == "wait":
    time.sleep(120)
sys.exit(int(mode) if mode != "wait" else 1)
"""


@pytest.mark.parametrize("options", [["--standalone", "--nproc-per-node=1"], ["--nproc_per_node=1", "--standalone"]])
def test_one_standalone_rank_is_started_directly(options) -> None:
    assert single_rank_command([*options, *RANK_ARGS]) == [sys.executable, "-u", *RANK_ARGS]


@pytest.mark.parametrize(
    "options",
    [
        ["--standalone", "--nproc-per-node=2"],
        ["--standalone", "--nproc-per-node=1", "--max-restarts=2"],
        ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29400"],
        ["--nproc-per-node=1"],
        ["--standalone", "--nproc-per-node", "1"],
    ],
)
def test_anything_more_runs_under_torchrun(options) -> None:
    assert single_rank_command([*options, *RANK_ARGS]) is None
    assert single_rank_command(["--standalone", "--nproc-per-node=1", "train.py"]) is None  # a script, not -m


def supervise(tmp_path: Path, mode: str) -> subprocess.Popen:
    (tmp_path / "launch_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code = (
        "import sys; from relayrl.trainer.launch import run_supervised; "
        f"sys.exit(run_supervised(['--standalone', '--nproc-per-node=1', '-m', 'launch_probe', {mode!r}]))"
    )
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)


def test_the_rank_gets_the_agents_environment_and_its_exit_code_comes_back(tmp_path) -> None:
    proc = supervise(tmp_path, "3")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3
    seen = json.loads(out)
    assert seen["world"] == 1 and seen["RANK"] == seen["LOCAL_RANK"] == "0" and seen["WORLD_SIZE"] == "1"
    assert seen["parent"] == proc.pid  # no agent in between


def test_sigterm_reaches_the_rank_and_a_killed_rank_is_a_failure(tmp_path) -> None:
    proc = supervise(tmp_path, "wait")
    seen = json.loads(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)  # forwarded: the rank stops cleanly, the supervisor exits with it
    assert proc.wait(timeout=60) == 0
    proc.stdout.close()

    proc = supervise(tmp_path, "wait")
    seen = json.loads(proc.stdout.readline())
    os.kill(seen["pid"], signal.SIGKILL)
    assert proc.wait(timeout=60) == 128 + signal.SIGKILL
    proc.stdout.close()
