"""`relayrl up examples/guess.yaml`, 10 steps: multi-turn episodes against a supervised environment server train
(samples with loss masks, per-step episode metrics) and the mean reward rises from the first 3 steps to the last 3,
later turns reuse the engine's prefix KV cache, the ledger notes how every episode ended, and an eval set of the
environment's tasks runs its episodes and reports the environment's reward. (The 40-step run,
0.32 -> 0.73 from the first 10 steps to the last 10, is bench/results/guess.json: `relayrl bench guess`.)"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
from integration.jobs import up_to_the_end

from relayrl.trainer.metrics import read_evals, read_metrics

ROOT = Path(__file__).resolve().parents[2]
ENDS = {"done", "truncated", "max_turns", "max_total_tokens", "deadline"}
pytestmark = pytest.mark.slow


@pytest.mark.timeout(1200)  # 10 steps of 32 episodes; the first run on a machine also builds builtin:tiny-chat
def test_guess_episodes_train_and_the_reward_rises(tmp_path):
    # a step's mean over 64 episodes moves by ~0.05; the recorded 40-step run went 0.17 over steps 1-3 -> 0.48 over
    # 8-10. At 10 steps, 3 against 3, this test failed 2 of 9 runs on 2026-12-07 (the reward flat at 0.19 once;
    # up to 0.44 by step 5, then back to 0.24 once): 16 steps, 4 against 4
    steps, window = 16, 4
    evals = ["eval.sets.tasks.path=examples/guess-tasks.jsonl", "eval.max_prompts=4", "eval.n=2", "eval.k=[1,2]"]
    evals.append("eval.temperature=1.0")  # two different episodes per task
    run_dir = tmp_path / "runs" / "guess"
    overrides = [f"run.dir={tmp_path / 'runs'}", f"trainer.steps={steps}", "trainer.checkpoint_every=0", *evals]
    up_to_the_end(ROOT / "examples/guess.yaml", overrides, cwd=ROOT, run_dir=run_dir, timeout=1100)

    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == steps
    for r in records:
        assert r["episodes"] >= r["samples_trained"] > 0
        assert r["turns_mean"] > 1 and r["turns_median"] >= 1
        assert r["observation_tokens_mean"] > 0  # trained rows hold observation deltas (loss mask 0) ...
        assert r["response_len_mean"] > r["observation_tokens_mean"]  # ... between sampled tokens (mask 1)
        assert r["env_seconds_mean"] > 0
        assert sum(v for k, v in r.items() if k.startswith("episode_end/")) == r["episodes"]
        assert {k.removeprefix("episode_end/") for k in r if k.startswith("episode_end/")} <= ENDS | {"failed"}
        assert "env/solved" in r
    rewards = [r["reward_mean"] for r in records]
    assert statistics.mean(rewards[-window:]) >= statistics.mean(rewards[:window]) + 0.05, rewards  # it learns

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

    # the eval set's rows are the environment's tasks: each ran eval.n = 2 episodes at one version, scored
    # by the environment's reward (reward.with_env: env), before training and after its last step
    results = read_evals(run_dir / "metrics.jsonl")
    assert [(r["eval"], r["step"], r["prompts"], r["prompts_failed"]) for r in results] == [
        ("tasks", 0, 4, 0), ("tasks", steps, 4, 0),
    ]  # fmt: skip
    generations = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    for result in results:
        episodes = [s for g in generations if g["step"] == result["step"] for s in g["samples"]]
        assert len(episodes) == 8 and all(s["versions"] == [result["step"]] for s in episodes)
        assert all(len(s["turns"]) >= 2 and s["turns"][-1]["role"] in ("assistant", "user", "tool") for s in episodes)
        assert result["mean@2"] == pytest.approx(sum(s["reward"] for s in episodes) / len(episodes))
        assert 0 <= result["pass@1"] <= result["pass@2"] <= 1
