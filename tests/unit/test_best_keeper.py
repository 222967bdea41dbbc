"""BestKeeper (relayrl/trainer/best.py): ``<run dir>/best`` names the best eval's export, and a crash between any
two of its switch's filesystem steps leaves it naming a whole export, the old or the new."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from relayrl.config import EvalConfig
from relayrl.trainer.best import BestKeeper

ECFG = EvalConfig(sets={"heldout": {"path": "h.jsonl"}}, every=1, best={"metric": "heldout/mean@1"})


class Crash(BaseException):
    """The process dying at a filesystem call (BaseException: no ``except Exception`` swallows it)."""


def export(keeper: BestKeeper, version: int) -> None:
    """A candidate export of ``version`` (its weights file names the version)."""
    path = keeper.candidate(version)
    path.mkdir(parents=True)
    (path / "model.safetensors").write_text(f"weights of {version}")


def best_weights(run: Path) -> str:
    return (run / "best" / "model.safetensors").read_text()


def crashing_at(monkeypatch, call: int) -> None:
    """The ``call``-th rename, link or tree deletion (counted from now) raises Crash, before it acts."""
    count = [0]

    def at(real):
        def wrapped(*args, **kwargs):
            count[0] += 1
            if count[0] == call:
                raise Crash
            return real(*args, **kwargs)

        return wrapped

    for module, name in [(os, "replace"), (os, "rename"), (os, "symlink"), (shutil, "rmtree")]:
        monkeypatch.setattr(module, name, at(getattr(module, name)))


def test_a_better_eval_replaces_best_and_a_worse_one_does_not(tmp_path: Path) -> None:
    keeper = BestKeeper(tmp_path, ECFG, last_step=3)
    for version, value in [(1, 0.5), (2, 0.4), (3, 0.7)]:
        export(keeper, version)
        keeper.offer({"eval": "heldout", "step": version, "mean@1": value})
        expected = 3 if version == 3 else 1
        assert best_weights(tmp_path) == f"weights of {expected}" and keeper.current()["step"] == expected
    assert [p.name for p in (tmp_path / "best-versions").iterdir()] == ["step_3"]  # the old export deleted
    keeper.close()
    assert not (tmp_path / "candidates").exists()


def test_a_crash_at_any_step_of_the_switch_leaves_best_whole(tmp_path: Path, monkeypatch) -> None:
    call = 1
    while True:
        run = tmp_path / f"crash_{call}"
        keeper = BestKeeper(run, ECFG, last_step=2)
        export(keeper, 1)
        keeper.offer({"eval": "heldout", "step": 1, "mean@1": 0.5})
        export(keeper, 2)
        with monkeypatch.context() as patch:
            crashing_at(patch, call)
            try:
                keeper.offer({"eval": "heldout", "step": 2, "mean@1": 0.9})
            except Crash:
                crashed = True
            else:
                crashed = False
        step = json.loads((run / "best" / "best.json").read_text())["step"]
        assert step in (1, 2) and best_weights(run) == f"weights of {step}", call
        restarted = BestKeeper(run, ECFG, last_step=2)  # the resumed run's keeper: nothing unnamed is left
        assert [p.name for p in (run / "best-versions").iterdir()] == [f"step_{step}"], call
        assert restarted.current()["step"] == step
        if not crashed:
            break
        call += 1
    assert call > 3  # the switch's moves, link and deletions were each crashed in turn


@pytest.mark.parametrize("mode", ["max", "min"])
def test_the_mode_decides_better(tmp_path: Path, mode: str) -> None:
    ecfg = ECFG.model_copy(update={"best": ECFG.best.model_copy(update={"mode": mode})})
    keeper = BestKeeper(tmp_path, ecfg, last_step=2)
    for version, value in [(1, 0.5), (2, 0.9)]:
        export(keeper, version)
        keeper.offer({"eval": "heldout", "step": version, "mean@1": value})
    assert keeper.current()["step"] == (2 if mode == "max" else 1)
