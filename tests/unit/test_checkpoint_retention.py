"""trainer.save_total_limit (relayrl/trainer/retention.py): the oldest complete checkpoints go; the newest complete
one, incomplete ones and the best one stay."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from relayrl.trainer.loop import latest_checkpoint
from relayrl.trainer.retention import prune_checkpoints


def make(checkpoints: Path, step: int, *, complete: bool = True) -> Path:
    path = checkpoints / f"step_{step}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard")
    if complete:
        (path / "trainer_state.json").write_text("{}")
    return path


def names(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.iterdir())


def test_keeps_the_newest_complete_ones(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        make(tmp_path, step)
    deleted = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == ["step_2", "step_4"]
    assert names(tmp_path) == ["step_6", "step_8"]
    assert prune_checkpoints(tmp_path, None) == [] and names(tmp_path) == ["step_6", "step_8"]


def test_never_the_one_a_resume_loads_nor_an_incomplete_one(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        make(tmp_path, step)
    make(tmp_path, 8, complete=False)  # a save in progress: not counted, not deleted
    prune_checkpoints(tmp_path, 1)
    assert names(tmp_path) == ["step_6", "step_8"]
    run = tmp_path.parent / "run"
    for step in (1, 2):
        make(run / "checkpoints", step)
    prune_checkpoints(run / "checkpoints", 1)
    assert latest_checkpoint(run) == run / "checkpoints" / "step_2"


def test_the_best_checkpoint_is_exempt(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        make(tmp_path, step)
    (tmp_path / "best").symlink_to("step_2")
    prune_checkpoints(tmp_path, 1)
    assert names(tmp_path) == ["best", "step_2", "step_8"]
    (tmp_path / "best").unlink()
    (tmp_path / "best").write_text("step_8\n")  # the best may also be the newest
    make(tmp_path, 10)
    prune_checkpoints(tmp_path, 1)
    assert names(tmp_path) == ["best", "step_10", "step_8"]


def test_the_evals_best_in_the_run_dir_is_exempt(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        make(checkpoints, step)
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text('{"step": 2, "score": 0.5}')
    prune_checkpoints(checkpoints, 1)
    assert names(checkpoints) == ["step_2", "step_6"]
    assert (tmp_path / "best" / "best.json").exists()


def test_a_failed_deletion_is_logged_the_run_goes_on_and_the_next_prune_retries_it(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    for step in (2, 4, 6):
        make(tmp_path, step)
    real = shutil.rmtree

    def refused(path, *args, **kwargs):
        if Path(path).name == "step_2":
            raise PermissionError(13, "Permission denied", str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", refused)
    with caplog.at_level(logging.WARNING, logger="relayrl.trainer.retention"):
        assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["step_4"]
    assert "could not delete" in caplog.text and "step_2" in caplog.text and "Permission denied" in caplog.text
    assert names(tmp_path) == ["step_2", "step_6"]
    assert not (tmp_path / "step_2" / "trainer_state.json").exists()  # incomplete: a resume never picks it
    monkeypatch.setattr(shutil, "rmtree", real)
    make(tmp_path, 8)
    assert sorted(p.name for p in prune_checkpoints(tmp_path, 1)) == ["step_2", "step_6"]
    assert names(tmp_path) == ["step_8"]
