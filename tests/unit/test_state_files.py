"""The state files a resume reads are written whole and durably (relayrl/runtime/files.py's atomic_write): the
file is fsynced before it is renamed into place, then its directory is fsynced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from relayrl.config import SamplesConfig, load_config
from relayrl.ops.resume import record_changes
from relayrl.trainer.backends.checkpoint_state import write_trainer_state
from relayrl.trainer.metrics import MetricsWriter
from relayrl.trainer.samples import SamplesWriter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    """The paths fsynced from now on, in order (a renamed temp file is recorded under its own name)."""
    paths: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return paths


def durably_written(path: Path, synced: list[str]) -> bool:
    """``path`` went through atomic_write: a temp file beside it fsynced, then its directory."""
    temp = [i for i, p in enumerate(synced) if Path(p).parent == path.parent and f".{path.name}.tmp" in p]
    return bool(temp) and str(path.parent) in synced[temp[-1] + 1 :] and path.is_file()


def test_trainer_state_json_is_fsynced_and_renamed_into_place(tmp_path: Path, synced) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        write_trainer_state(tmp_path, {"step": 3, "policy_version": 3})
    finally:
        dist.destroy_process_group()
    assert durably_written(tmp_path / "trainer_state.json", synced), synced


def test_the_resume_rewrites_are_fsynced_and_renamed_into_place(tmp_path: Path, synced) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 3)))
    MetricsWriter(metrics, resume_step=2).close()
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n' and durably_written(metrics, synced)
    samples = tmp_path / "samples.jsonl"
    samples.write_text('{"step": 1}\n{"step": 5}\n')
    SamplesWriter(samples, SamplesConfig(), resume_step=2).close()
    assert samples.read_text() == '{"step": 1}\n' and durably_written(samples, synced)
    cfg = load_config(ROOT / "examples" / "digits.yaml", [f"run.dir={tmp_path}", "run.name=try"])
    cfg.run_dir.mkdir()
    record_changes(cfg, ["trainer.steps: 200 -> 300"])
    assert durably_written(cfg.run_dir / "config.yaml", synced)


def test_a_metrics_line_still_being_written_is_left_for_the_next_read(tmp_path: Path) -> None:
    """``relayrl up`` reads metrics.jsonl while the trainer appends to it: a line without its newline yet is not a
    record (reading it once crashed the launcher with a JSONDecodeError), and it is read once it is whole."""
    from relayrl.trainer.metrics import read_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "rew')
    assert read_metrics(metrics) == [{"step": 1, "reward_mean": 0.5}]
    with metrics.open("a") as f:
        f.write('ard_mean": 0.75}\n')
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2]
