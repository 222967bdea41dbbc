"""The best checkpoint by one eval metric (``eval.best``): ``<run dir>/best``, a Hugging Face export with best.json.

Every rank exports the weights of each evaluated version v (``EvalConfig.evaluates``) to ``<run dir>/candidates/
step_v`` as the step's weights are published (an export is collective). When the eval of v arrives (rank 0,
``offer``), its candidate replaces ``best`` if its metric beats best.json's (higher with mode max, lower with
min), and the candidates up to v are deleted. best.json holds ``step`` and ``policy_version`` (v), ``metric``,
``value``, ``mode``; it survives ``--resume`` with the run directory, and a resume never lowers it (the results
already logged are not offered again). ``relayrl eval --checkpoint runs/NAME/best`` scores it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from relayrl.config import EvalConfig

log = logging.getLogger(__name__)


class BestKeeper:
    def __init__(self, run_dir: Path, ecfg: EvalConfig, last_step: int) -> None:
        assert ecfg.best is not None
        self.best_dir, self.candidates = run_dir / "best", run_dir / "candidates"
        self.ecfg, self.last_step = ecfg, last_step
        self.set_name, _, self.metric = ecfg.best.metric.partition("/")

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
            (candidate / "best.json").write_text(
                json.dumps({"step": version, "policy_version": version, "metric": self.ecfg.best.metric,
                            "value": value, "mode": self.ecfg.best.mode})
            )  # fmt: skip
            old = self.best_dir.with_name("best.old")
            if self.best_dir.exists():
                self.best_dir.replace(old)
            candidate.replace(self.best_dir)
            shutil.rmtree(old, ignore_errors=True)
            log.info(
                "best checkpoint: version %d (%s %.4f) -> %s", version, self.ecfg.best.metric, value, self.best_dir
            )
        for path in self.candidates.glob("step_*"):
            if int(path.name.removeprefix("step_")) <= version:
                shutil.rmtree(path)

    def close(self) -> None:
        """The end of the run: candidates whose eval never came are deleted."""
        if self.candidates.exists():
            shutil.rmtree(self.candidates)
