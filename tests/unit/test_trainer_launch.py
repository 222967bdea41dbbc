"""``relayrl trainer launch``: one standalone rank runs without torchrun's agent, with the agent's environment;
SIGTERM still reaches it and its exit code comes back; N standalone ranks of relayrl.cli are forked, and the first
that fails stops the others (as the agent does) with its exit code; anything more runs under torchrun. The forked
ranks train through `relayrl up` (tests/integration/test_end_to_end.py, test_faults.py) and `relayrl train sft`
(tests/unit/test_train_sft.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.trainer.launch import rank_env, single_rank_command, standalone_ranks

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


def test_standalone_ranks_are_counted_from_exactly_standalone_and_nproc_per_node() -> None:
    assert standalone_ranks(["--standalone", "--nproc-per-node=2", *RANK_ARGS]) == 2
    assert standalone_ranks(["--nproc_per_node=3", "--standalone", *RANK_ARGS]) == 3
    for options in (["--standalone", "--nproc-per-node=2", "--max-restarts=1"], ["--nproc-per-node=2"], []):
        assert standalone_ranks([*options, *RANK_ARGS]) is None, options
    assert standalone_ranks(["--standalone", "--nproc-per-node=2", "train.py"]) is None
    env = rank_env(1, 2, 29999)
    assert env["RANK"] == env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
    assert env["MASTER_PORT"] == "29999" and env["TORCHELASTIC_USE_AGENT_STORE"] == "False"


# Two forked ranks: rank 0 ends as asked (an exit code, or SIGKILL), rank 1 waits for SIGTERM (the trainer's clean
# stop) and exits 0; the supervisor's exit code is rank 0's.
RANKS = """
import os, signal, sys, time
from relayrl.trainer.launch import wait_ranks
ranks = []
for rank in range(2):
    pid = os.fork()
    if pid == 0:
        if rank == 0:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL) if sys.argv[1] == "kill" else os._exit(int(sys.argv[1]))
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        time.sleep(120)
        os._exit(1)
    ranks.append(pid)
sys.exit(wait_ranks(ranks))
"""


@pytest.mark.parametrize(("rank0", "code"), [("3", 3), ("kill", 128 + signal.SIGKILL)])
def test_a_failed_rank_stops_the_others_and_its_code_comes_back(rank0: str, code: int) -> None:
    done = subprocess.run([sys.executable, "-c", RANKS, rank0], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr[-2000:]


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
