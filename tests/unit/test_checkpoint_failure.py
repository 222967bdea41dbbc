"""A checkpoint that cannot be written fails in one line naming its directory, the free space there and the cause
(torch's own words for a short write on a full disk are "unexpected pos A vs B")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from relayrl.config import TrainerConfig
from relayrl.runtime import files
from relayrl.runtime.files import free_space_text
from relayrl.trainer.loop import save_checkpoint


class FullDiskBackend:
    def save_checkpoint(self, directory: Path, trainer_state: dict) -> None:
        raise RuntimeError(
            "CheckpointException ranks:dict_keys([0])\nTraceback (most recent call last): (RANK 0)\n"
            "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598\n"
        )


def test_a_failed_save_names_the_directory_the_free_space_and_the_cause(tmp_path, monkeypatch) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: usage._replace(free=816 * 1024))
    with pytest.raises(RuntimeError) as failed:
        save_checkpoint(FullDiskBackend(), tmp_path / "run", 3, 24, TrainerConfig())
    message = str(failed.value)
    assert message == (
        f"checkpoint of step 3 into {tmp_path / 'run' / 'checkpoints' / 'step_3'} failed (816.0 KiB free there): "
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    )


def test_free_space_reads_the_nearest_existing_parent(tmp_path) -> None:
    assert free_space_text(tmp_path / "not" / "made" / "yet").endswith(" free")
    assert free_space_text(tmp_path).split()[1] in ("GiB", "MiB", "KiB")
