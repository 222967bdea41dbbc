"""The best checkpoint by one eval metric (``eval.best``): ``<run dir>/best``, a Hugging Face export with best.json.

Every rank exports the weights of each evaluated version v (``EvalConfig.evaluates``) to ``<run dir>/candidates/
step_v`` as the step's weights are published (an export is collective). When the eval of v arrives (rank 0,
``offer``), its candidate replaces ``best`` if its metric beats best.json's (higher with mode max, lower with
min), and the candidates up to v are deleted. best.json holds ``step`` and ``policy_version`` (v), ``metric``,
``value``, ``mode``; it survives ``--resume`` with the run directory, and a resume never lowers it (the results
already logged are not offered again). ``relayrl eval --checkpoint runs/NAME/best`` scores it.

``best`` is a symlink to ``best-versions/step_v``, switched atomically: the candidate is moved into best-versions
(``best`` still names the old export), a new link is renamed over ``best`` (one rename(2): old or new, never
neither), then the old export is deleted. A crash between any two steps leaves ``best`` naming a whole export;
the export a crash left unnamed in best-versions is deleted when the next keeper starts.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from relayrl.config import EvalConfig
from relayrl.runtime.files import atomic_write, fsync_path

log = logging.getLogger(__name__)


class BestKeeper:
    def __init__(self, run_dir: Path, ecfg: EvalConfig, last_step: int) -> None:
        assert ecfg.best is not None
        self.best_dir, self.candidates = run_dir / "best", run_dir / "candidates"
        self.versions = run_dir / "best-versions"  # the exports ``best`` links to: the one it names, a crash's other
        self.ecfg, self.last_step = ecfg, last_step
        self.set_name, _, self.metric = ecfg.best.metric.partition("/")
        self._drop_unnamed()

    def candidate(self, version: int) -> Path | None:
        """Where the weights of ``version`` are exported (None: it is not evaluated)."""
        return self.candidates / f"step_{version}" if self.ecfg.evaluates(version, self.last_step) else None

    def current(self) -> dict | None:
        marker = self.best_dir / "best.json"
        return json.loads(marker.read_text()) if marker.is_file() else None

    def better(self, value: float) -> bool:
        best = self.current()
        if best is None:
            return True
        return value > best["value"] if self.ecfg.best.mode == "max" else value < best["value"]

    def offer(self, record: dict) -> None:
        """An eval line (metrics.jsonl's): its candidate becomes ``best`` when it is better; candidates up to its
        version go."""
        if record["eval"] != self.set_name or self.metric not in record:
            return
        version, value = record["step"], record[self.metric]
        candidate = self.candidates / f"step_{version}"
        if candidate.is_dir() and self.better(value):
            atomic_write(
                candidate / "best.json",
                json.dumps({"step": version, "policy_version": version, "metric": self.ecfg.best.metric,
                            "value": value, "mode": self.ecfg.best.mode})
            )  # fmt: skip
            self._switch(candidate)
            log.info(
                "best checkpoint: version %d (%s %.4f) -> %s", version, self.ecfg.best.metric, value, self.best_dir
            )
        for path in self.candidates.glob("step_*"):
            if int(path.name.removeprefix("step_")) <= version:
                shutil.rmtree(path)

    def _switch(self, candidate: Path) -> None:
        """Make ``best`` name ``candidate`` (module docstring: every step leaves it naming a whole export)."""
        self.versions.mkdir(exist_ok=True)
        target = self.versions / candidate.name
        if target.exists():  # a resumed run exported this version again: the old copy is named by nothing
            shutil.rmtree(target)
        candidate.replace(target)
        if self.best_dir.is_dir() and not self.best_dir.is_symlink():  # a run's best from before the link
            self.best_dir.replace(self.versions / "unlinked")
        link = self.best_dir.with_name("best.link")
        link.unlink(missing_ok=True)
        link.symlink_to(Path(self.versions.name) / target.name)
        link.replace(self.best_dir)
        fsync_path(self.best_dir.parent)
        self._drop_unnamed()

    def _drop_unnamed(self) -> None:
        """Delete the exports in best-versions that the ``best`` link does not name (the old best, or a crash's
        leftover); none while ``best`` is no link (a run's best from before the link, moved in by ``_switch``)."""
        if not self.best_dir.is_symlink():
            return
        named = self.best_dir.resolve().name
        for path in self.versions.iterdir() if self.versions.is_dir() else ():
            if path.name != named:
                shutil.rmtree(path)

    def close(self) -> None:
        """The end of the run: candidates whose eval never came are deleted."""
        if self.candidates.exists():
            shutil.rmtree(self.candidates)
