"""``relayrl bench prefix`` on the tiny chat model: prompts whose chat template begins alike (reasoning-gym's system
turn) prefill that beginning once on the sharing engine and in full on the other, with the same greedy tokens."""

from __future__ import annotations

import json

import pytest

from relayrl.bench.prefix import main
from relayrl.bench.record import ROOT
from relayrl.rollout import batcher
from relayrl.rollout.batcher import MIN_SHARED_BEGINNING


def test_the_sharing_engine_prefills_the_common_beginning_once(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(ROOT / "examples" / "reasoning-gym.yaml")
    sets = ["--set", "rollout.weight_dtype=float32", "--set", f"run.dir={tmp_path}"]
    assert main(["--config", config, "--prompts", "4", "--rounds", "2", "--system-words", "0", *sets]) == 0
    result = json.loads(capsys.readouterr().out)
    shared, full, prompts = result["shared"], result["full"], result["prompt_tokens"]
    assert len(prompts) == 4 and (full["prefilled"], full["reused"]) == (sum(prompts), 0)
    beginning, left = divmod(shared["reused"], len(prompts))
    assert left == 0 and MIN_SHARED_BEGINNING <= beginning < min(prompts), "each prompt reused the one beginning"
    assert shared["prefilled"] == beginning + sum(prompts) - shared["reused"]
    assert all(len(result[side]["seconds"]) == 2 for side in ("shared", "full")) and result["full_over_shared"] > 0
    assert result["differing_tokens"] == 0
    assert result["machine"]["resolved"]["relayrl"]["precision"] == "float32"
    assert batcher.MIN_SHARED_BEGINNING == MIN_SHARED_BEGINNING, "the bench left the engine's threshold as it was"
