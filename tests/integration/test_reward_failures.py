"""A reward function that raises, through ``relayrl up`` (issue 36, item 10): one that raises on every call stops
the run within its first step with the function's error and traceback on the console and in the controller's log,
exit 1, the trainer never restarted; one that raises on 1 % of calls trains on, and the summary counts the failed
prompts by reason."""

from __future__ import annotations

import json
import os

import pytest

from relayrl.config import load_config
from relayrl.trainer.metrics import read_metrics

from .jobs import finish, start_up, supervised_roles

pytestmark = pytest.mark.slow

SOURCE = """
import itertools

CALLS = itertools.count(1)


def always(response, answer):
    raise ValueError("the judge is down")


def flaky(response, answer):
    if next(CALLS) % 100 == 0:  # 1 % of calls
        raise TimeoutError("the judge timed out")
    return float(response.strip() == answer)
"""


@pytest.mark.timeout(900)
def test_a_raising_reward_stops_the_run_at_once_and_a_flaky_one_trains_on_counted(tmp_path, make_config):
    (tmp_path / "judges.py").write_text(SOURCE)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    shape = {"prompts_per_gen_batch": 16, "train_batch_groups": 16, "dynamic_sampling": False}

    broken = make_config("broken", controller={**shape, "reward": {"fn": "judges:always"}})
    code, err = finish(start_up(broken, env=env))
    cfg = load_config(broken)
    assert code == 1, err
    assert "run stopped: step 1: 16 of the 16 prompts scored failed their reward function" in err, err
    assert "Traceback (most recent call last)" in err and "ValueError: the judge is down" in err, err
    assert 'raise ValueError("the judge is down")' in err, err  # the function's own line
    controller_log = (cfg.run_dir / "logs" / "controller.log").read_text()
    assert 'raise ValueError("the judge is down")' in controller_log
    assert read_metrics(cfg.run_dir / "metrics.jsonl") == []
    assert supervised_roles(cfg)["trainer"]["restarts"] == 0

    steps = 4  # 64 calls a step (16 prompts x 4 responses): one failure in steps 2 and 4, 1 of 16 < 0.1
    flaky = make_config("flaky", controller={**shape, "reward": {"fn": "judges:flaky"}}, trainer={"steps": steps})
    code, err = finish(start_up(flaky, env=env))
    cfg = load_config(flaky)
    assert code == 0, err
    assert len(read_metrics(cfg.run_dir / "metrics.jsonl")) == steps
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    reason = "reward function 'judges:flaky' raised TimeoutError"
    assert set(summary["prompts_failed_by_reason"]) == {reason}, summary
    assert summary["prompts_failed"] == summary["prompts_failed_by_reason"][reason] >= 2
    assert f"failed prompts: {reason}" in err
