"""A run's samples repeat at a fixed ``run.seed`` (``rollout.seed_requests``, "auto": on for the hf engine), as a
user meets it: ``relayrl up examples/digits.yaml`` twice at seed 0 logs the same responses at every step, through
one rollout worker serving two calls at once (the example's four-prompt chunks), dynamic sampling and the trainer's
updates in between, and its samples differ from one another. Unit level: tests/unit/test_dispatch.py (each call's
seed, which another run.seed changes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def logged_responses(tmp_path: Path, name: str, seed: int) -> list[tuple[int, str, list[str]]]:
    """(step, prompt id, responses) of every group the samples log wrote in a ``STEPS``-step digits run."""
    sets = [
        f"run.dir={tmp_path / 'runs'}", f"run.name={name}", f"run.seed={seed}", f"trainer.steps={STEPS}",
        "trainer.checkpoint_every=0", "eval=null", "samples.every=1", "samples.prompts=8", "rollout.workers=1",
    ]  # fmt: skip
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(ROOT / "examples" / "digits.yaml")]
    done = subprocess.run(
        [*argv, *(arg for s in sets for arg in ("--set", s))], cwd=tmp_path, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    run_dir = tmp_path / "runs" / name
    logs = "".join(p.read_text()[-2000:] for p in (run_dir / "logs").glob("*.log")) if run_dir.exists() else ""
    assert done.returncode == 0, done.stderr[-3000:] + logs
    groups = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({g["step"] for g in groups}) == list(range(1, STEPS + 1))
    return [(g["step"], g["prompt_id"], [s["response"] for s in g["samples"]]) for g in groups]


def test_a_run_repeats_its_samples_at_a_fixed_seed(tmp_path: Path) -> None:
    first, again = logged_responses(tmp_path, "a", 0), logged_responses(tmp_path, "b", 0)
    assert len(first) == 8 * STEPS
    assert first == again
    assert len({response for _, _, responses in first for response in responses}) > 1  # sampled, not one answer
