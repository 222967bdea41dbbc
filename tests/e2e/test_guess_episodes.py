"""`relayrl up examples/guess.yaml`, a few steps: multi-turn episodes against a supervised environment server train
(samples with loss masks, per-step episode metrics), later turns reuse the engine's prefix KV cache, and the ledger
notes how every episode ended."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ENDS = {"done", "truncated", "max_turns", "max_total_tokens", "deadline"}
pytestmark = pytest.mark.slow


def test_guess_episodes_train(tmp_path):
    steps = 3
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(ROOT / "examples/guess.yaml")]
    for override in [f"run.dir={tmp_path / 'runs'}", f"trainer.steps={steps}", "trainer.checkpoint_every=0"]:
        argv += ["--set", override]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    run_dir = tmp_path / "runs" / "guess"
    logs = "".join(p.read_text()[-2000:] for p in (run_dir / "logs").glob("*.log")) if run_dir.exists() else ""
    assert done.returncode == 0, done.stderr[-3000:] + logs

    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == steps
    for r in records:
        assert r["episodes"] >= r["samples_trained"] > 0
        assert r["turns_mean"] > 1 and r["turns_median"] >= 1
        assert r["observation_tokens_mean"] > 0  # trained rows hold observation deltas (loss mask 0) ...
        assert r["response_len_mean"] > r["observation_tokens_mean"]  # ... between sampled tokens (mask 1)
        assert r["env_seconds_mean"] > 0 and r["tool_parse_errors"] >= 0
        assert sum(v for k, v in r.items() if k.startswith("episode_end/")) == r["episodes"]
        assert {k.removeprefix("episode_end/") for k in r if k.startswith("episode_end/")} <= ENDS | {"failed"}
        assert "env/solved" in r

    # later turns prefill only their new tokens on the hf engine's prefix KV cache; the worker logs its counts at
    # every weight update (docs/engines.md)
    counts = re.findall(
        r"(\d+) prefilled, (\d+) from the prefix cache", (run_dir / "logs" / "rollout-0.log").read_text()
    )
    prefilled, reused = map(int, counts[-1])
    assert reused > prefilled > 0

    events = [json.loads(line) for line in (run_dir / "controller" / "ledger.jsonl").read_text().splitlines()]
    notes = {e["id"]: e["episodes"] for e in events if "episodes" in e}
    trained = {e["id"] for e in events if e.get("state") == "trained"}
    assert trained and trained <= set(notes)
    assert all(len(notes[pid]) == 8 and set(notes[pid]) <= ENDS for pid in trained)
