"""Two trainer ranks (torchrun, gloo, the tiny model) resume at the step rank 0 chose, whatever each one's own
run directory holds: rank 1's is empty, as on a pod whose disk was not the one the checkpoints went to. The
checkpoints are in the shared directory rank 0 sees; the newest one there has no trainer_state.json (a save cut
short) and is skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.runtime.ports import free_port

pytestmark = pytest.mark.slow

RANK_SCRIPT = """
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from relayrl.config import parse_config
from relayrl.trainer.backends import create_backend
from relayrl.trainer.loop import resume_point, save_checkpoint
from relayrl.trainer.world import init_world

model, shared, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
init_world("gloo")
rank = dist.get_rank()
trainer = {"nproc": 2, "threads": 1, "precision": "float32"}
cfg = parse_config({"model": {"path": model}, "data": {"path": "unused.jsonl"}, "trainer": trainer})
backend = create_backend(cfg.model, cfg.trainer, with_reference=False)
def total():  # the sum of every full parameter: the same on each rank once they hold the same weights
    full = (p.full_tensor() if hasattr(p, "full_tensor") else p for p in backend.model.parameters())
    return float(sum(t.detach().double().sum() for t in full))

def shift(by: float):
    with torch.no_grad():
        for p in backend.model.parameters():
            p.add_(by)

save_checkpoint(backend, shared, 2, 20, cfg.trainer)  # every rank writes its shards; rank 0 trainer_state.json
shift(0.5)
save_checkpoint(backend, shared, 4, 40, cfg.trainer)
saved = total()
shift(0.25)
save_checkpoint(backend, shared, 6, 60, cfg.trainer)
if rank == 0:
    (shared / "checkpoints" / "step_6" / "trainer_state.json").unlink()  # incomplete: the save was cut short
shift(1.0)
dist.barrier()
own = shared if rank == 0 else out / "rank1-run"  # rank 1's own run dir: empty
own.mkdir(parents=True, exist_ok=True)
step, cursor = resume_point(backend, own, cfg.trainer)
(out / f"rank{rank}.json").write_text(json.dumps({"step": step, "cursor": cursor, "sum": total(), "saved": saved}))
dist.barrier()  # as run_trainer ends: a rank that tears its group down while its peer is still in one aborts
dist.destroy_process_group()
"""


def test_ranks_resume_at_rank0s_checkpoint_when_their_run_dirs_differ(tmp_path: Path, tiny_model_dir: Path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    shared = tmp_path / "shared-run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(script), str(tiny_model_dir), str(shared), str(tmp_path),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["step"], r["cursor"]) for r in ranks] == [(4, 40), (4, 40)], ranks
    for r in ranks:  # the weights are step 4's, on both ranks
        assert r["sum"] == pytest.approx(r["saved"], rel=1e-6), r
    assert not any((tmp_path / "rank1-run").iterdir())
