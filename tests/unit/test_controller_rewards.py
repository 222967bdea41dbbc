"""The controller and a user's reward function: a wrong return shape stops the run with the function's error and
fails the prompts drawn for the step (nothing trained on a made-up score); a function that raises fails its own
prompt and the batch fills with the others, unless more of the step's prompts failed than
controller.reward.max_failed_share allows (the run stops with the first error and its traceback); a function that
fits no form stops the controller at start."""

from __future__ import annotations

import json
import sys

import pytest

from relayrl.config import load_config
from relayrl.controller.core import Controller
from relayrl.controller.ledger import FAILED, TRAINED
from tests.unit.test_controller_failure import ScriptedDispatcher, started, wait_for

SOURCE = """
def wrong_length(responses, rows):
    return [1.0]


CALLS = []


def flaky(responses, rows):
    CALLS.append(rows[0]["prompt"])
    if len(CALLS) == 2:
        raise TimeoutError("judge timed out")
    return [float(i) for i in range(len(responses))]


def three_args(a, b, c):
    return 0.0
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "ctl_rewards.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ctl_rewards", raising=False)  # each test counts its own calls
    return "ctl_rewards"


def config(make_config, fn: str, max_failed_share: float = 0.1):
    controller = {"dynamic_sampling": False, "reward": {"fn": fn, "max_failed_share": max_failed_share}}
    return load_config(make_config(controller=controller, trainer={"steps": 5}))


def ledger_events(ctl: Controller) -> list[dict]:
    return [json.loads(line) for line in (ctl.state_dir / "ledger.jsonl").read_text().splitlines()]


def test_a_wrong_return_shape_stops_the_run_naming_the_function_and_fails_the_step_prompts(
    make_config, tmp_path, reward_module
) -> None:
    cfg = config(make_config, f"{reward_module}:wrong_length")
    ctl = started(cfg, tmp_path, ScriptedDispatcher(cfg.rollout.n))
    try:
        wait_for(lambda: ctl.state == "failed")
        message = "reward function 'ctl_rewards:wrong_length' (batched) returned list of 1 for a group of 4 responses"
        assert message in ctl.error
        assert ctl.batches_ready == 0  # nothing to train on
        failed = [e for e in ledger_events(ctl) if e["state"] == FAILED]
        assert len(failed) == cfg.controller.prompts_per_gen_batch  # the round's prompts, each with the error
        assert all(message in e["reason"] for e in failed)
        assert ctl.ledger.counts() == {FAILED: cfg.controller.prompts_per_gen_batch}
    finally:
        ctl.stop()


def test_a_function_that_raises_fails_its_prompt_and_the_batch_fills_with_the_others(
    make_config, tmp_path, reward_module
) -> None:
    cfg = config(make_config, f"{reward_module}:flaky", max_failed_share=0.5)  # 1 of the round's 4 prompts fails
    ctl = started(cfg, tmp_path, ScriptedDispatcher(cfg.rollout.n))
    try:
        wait_for(lambda: ctl.batches_ready >= 1)
        batch = ctl.pull_batch(1, timeout_s=5)
        failed = {e["id"]: e["reason"] for e in ledger_events(ctl) if e["state"] == FAILED}
        assert list(failed.values()) == ["reward function 'ctl_rewards:flaky' raised TimeoutError: judge timed out"]
        trained_ids = {s.prompt_id for s in batch.samples}
        assert len(trained_ids) == cfg.controller.train_batch_groups and not trained_ids & set(failed)
        assert sorted(s.score for s in batch.samples if s.group == 0) == [0.0, 1.0, 2.0, 3.0]
        assert ctl.state == "running" and TRAINED not in ctl.ledger.counts()
    finally:
        ctl.stop()


def test_more_failures_than_the_share_allows_stop_the_run_with_the_first_error_and_its_traceback(
    make_config, tmp_path, reward_module, caplog
) -> None:
    cfg = config(make_config, f"{reward_module}:flaky")  # 1 of 4 is more than the default 0.1
    ctl = started(cfg, tmp_path, ScriptedDispatcher(cfg.rollout.n))
    try:
        wait_for(lambda: ctl.state == "failed")
        assert ctl.error.startswith("run stopped: step 1: 1 of the 4 prompts scored failed their reward function")
        assert ctl.error.endswith("the first: reward function 'ctl_rewards:flaky' raised TimeoutError: judge timed out")
        assert ctl.batches_ready == 0 and ctl.ledger.counts() == {FAILED: 4}
        assert ctl.ledger.reason_kinds(FAILED) == {
            "reward function 'ctl_rewards:flaky' raised TimeoutError": 1,
            "run stopped": 3,  # the round's other prompts, failed with the run
        }
        logged = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
        assert 'raise TimeoutError("judge timed out")' in logged  # the function's own line, in the traceback
    finally:
        ctl.stop()


def test_a_function_that_fits_no_form_stops_the_controller_at_start(make_config, tmp_path, reward_module) -> None:
    cfg = config(make_config, f"{reward_module}:three_args")
    with pytest.raises(ValueError, match=r"^controller.reward.fn: reward function ctl_rewards:three_args\(a, b, c\)"):
        Controller(cfg, state_dir=tmp_path / "state")
