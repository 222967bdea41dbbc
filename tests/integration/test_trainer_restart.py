"""torchrun's in-place restart (``--max-restarts``, what the Slurm and Kubernetes trainers rely on) forms a
new default process group: the restarted attempt does not read the dead attempt's gloo addresses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.runtime.ports import free_port

pytestmark = pytest.mark.slow

RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from relayrl.trainer.world import init_world, restart_attempt
init_world("gloo")
value = torch.tensor([float(restart_attempt() + 1)])
dist.broadcast(value, 0)
if restart_attempt() == 0 and dist.get_rank() == 0:
    sys.exit("rank 0 dies in the first attempt")
dist.barrier()
open(f"{sys.argv[1]}/rank{dist.get_rank()}-attempt{restart_attempt()}", "w").write(str(value.item()))
dist.destroy_process_group()  # as the trainer does: an exit with the group alive can abort in gloo's teardown
"""


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_restarted_attempt_forms_its_process_group(tmp_path: Path, rendezvous: str):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()
    where = {
        "static": ["--master-addr", "127.0.0.1", "--master-port", str(port)],  # relayrl.sbatch's form
        "c10d": ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t"],
    }[rendezvous]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", *where]
    res = subprocess.run(
        [*cmd, "--max-restarts", "1", str(script), str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("rank*-attempt*")) == ["rank0-attempt1", "rank1-attempt1"]
    assert {p.read_text() for p in tmp_path.glob("rank*-attempt1")} == {"2.0"}
