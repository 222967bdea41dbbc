"""When batch production cannot go on. A failed run's producer waits for a rewind instead of dying: the trainer
restarted by the supervisor rewinds the controller to its checkpoint, and production picks up from there (before,
the producer thread had returned, and the restarted trainer waited for a batch that never came). Dynamic sampling
that finds too few informative groups (a converged policy) tops the batch up with zero-advantage groups under
``on_exhausted: partial`` and fails the run under ``fail``. A fresh run in pause mode generates nothing before the
trainer's starting weights are out."""

from __future__ import annotations

import json
import time

import pytest
import torch

from relayrl.algorithms.routing_replay import to_message
from relayrl.config import load_config
from relayrl.controller.core import Controller
from relayrl.controller.dispatch import DispatchResult
from relayrl.controller.ledger import FAILED
from relayrl.errors import InvalidArgument
from relayrl.v1 import common_pb2, controller_pb2


class ScriptedDispatcher:
    """Stands in for Dispatcher.run: the first ``failures`` calls fail (a worker bug, say), later ones complete every
    group; ``same_answers``: every sample of a group is the same completion (so its rewards are all equal)."""

    def __init__(self, n: int, *, failures: int = 0, same_answers: bool = False) -> None:
        self.n, self.failures, self.same_answers, self.calls = n, failures, same_answers, 0

    def run(self, prompts, params, *, min_version, on_group=None, **_):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("engine crashed")
        result = DispatchResult()
        for job in prompts:
            result.groups[job.prompt_id] = [
                common_pb2.Completion(
                    prompt_id=job.prompt_id, sample_index=i, token_ids=[5 if self.same_answers else 5 + i],
                    logprobs=[-1.0], finish_reason=common_pb2.FINISH_REASON_STOP, policy_version=min_version,
                    worker_id="w0",
                )
                for i in range(self.n)
            ]  # fmt: skip
        return result


INITIAL = controller_pb2.ReportWeightSyncRequest(synced_worker_ids=["w0"], reason="initial")  # trainer rank 0's


def started(cfg, tmp_path, dispatcher, *, published: bool = True) -> Controller:
    """A controller with one registered worker; ``published``: the trainer's starting weights are out."""
    ctl = Controller(cfg, state_dir=tmp_path / "state")
    ctl.dispatcher = dispatcher
    ctl.registry.register("w0", "127.0.0.1:1", "hf", 0)
    ctl.start()
    if published:
        ctl.report_weight_sync(INITIAL)
    return ctl


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("opened_by", ["initial", "rewind"])
def test_a_fresh_run_in_pause_mode_generates_once_the_starting_weights_are_out(make_config, tmp_path, opened_by):
    """The trainer's first publish pauses every worker and aborts its calls in flight: under ``relayrl up`` each
    clean start generated its first round twice, with a warning for each call. Production now waits for the
    trainer's "initial" report, or a Rewind (a resumed trainer publishes its checkpoint's weights first); a
    restarted controller of that run does not wait again."""
    cfg = load_config(make_config(controller={"dynamic_sampling": False}, trainer={"steps": 5}))
    ctl = started(cfg, tmp_path, ScriptedDispatcher(cfg.rollout.n), published=False)
    try:
        time.sleep(1.5)  # the producer polls every 0.5 s: three chances to start too early
        assert ctl.dispatcher.calls == 0 and ctl.batches_ready == 0
        if opened_by == "initial":
            ctl.report_weight_sync(INITIAL)
        else:
            ctl.rewind(controller_pb2.RewindRequest(step=0, cursor=0, synced_worker_ids=["w0"]))
        wait_for(lambda: ctl.batches_ready >= 1)
    finally:
        ctl.stop()
    assert json.loads((tmp_path / "state" / "state.json").read_text())["exact_version"] == 0  # what opens production


def test_a_fresh_run_in_shadow_mode_generates_at_once(make_config, tmp_path) -> None:
    """Shadow mode swaps new weights in between calls: rows in flight are never aborted, so nothing waits."""
    cfg = load_config(make_config(controller={"dynamic_sampling": False}, weight_sync={"mode": "shadow"}))
    ctl = started(cfg, tmp_path, ScriptedDispatcher(cfg.rollout.n), published=False)
    try:
        wait_for(lambda: ctl.batches_ready >= 1)
    finally:
        ctl.stop()


def test_a_failed_run_produces_again_after_a_rewind(make_config, tmp_path) -> None:
    cfg = load_config(make_config(controller={"dynamic_sampling": False}, trainer={"steps": 5}))
    ctl = started(cfg, tmp_path, ScriptedDispatcher(cfg.rollout.n, failures=1))
    try:
        wait_for(lambda: ctl.state == "failed")
        assert "engine crashed" in ctl.error
        ctl.rewind(controller_pb2.RewindRequest(step=0, cursor=0))  # what a restarted trainer sends
        assert ctl.state == "running" and not ctl.error
        wait_for(lambda: ctl.batches_ready >= 1)
        assert ctl.dispatcher.calls >= 2
    finally:
        ctl.stop()


def test_a_rewind_past_the_reported_step_is_refused_and_changes_nothing(make_config, tmp_path) -> None:
    """A trainer checkpoints a step only after reporting it, so a rewind to a later step cannot come from one;
    taken, it would set the policy version to weights no worker will ever get, and every client prompt would
    wait for them (the fuzz test found step 16200 doing that)."""
    cfg = load_config(make_config(controller={"dynamic_sampling": False}, trainer={"steps": 5}))
    ctl = started(cfg, tmp_path, ScriptedDispatcher(cfg.rollout.n))
    try:
        wait_for(lambda: ctl.batches_ready >= 1)
        with pytest.raises(InvalidArgument, match=r"^step: 16200 is past the last step the trainer reported \(0\)"):
            ctl.rewind(controller_pb2.RewindRequest(step=16200, cursor=0))
        assert ctl.progress.policy_version == 0 and ctl.batches_ready >= 1  # nothing rewound
        ctl.rewind(controller_pb2.RewindRequest(step=0, cursor=0))  # what a restarted trainer sends
        assert ctl.progress.policy_version == 0 and ctl.state == "running"
    finally:
        ctl.stop()


@pytest.mark.parametrize("on_exhausted", ["partial", "fail"])
def test_a_converged_policy_trains_on_zero_advantage_groups_or_fails_the_run(make_config, tmp_path, on_exhausted):
    controller = {"dynamic_sampling": True, "max_gen_batches": 2, "on_exhausted": on_exhausted}
    cfg = load_config(make_config(controller=controller, trainer={"steps": 5, "mini_batches": 2}))
    ctl = started(cfg, tmp_path, ScriptedDispatcher(cfg.rollout.n, same_answers=True))
    try:
        if on_exhausted == "fail":
            wait_for(lambda: ctl.state == "failed")
            assert "dynamic sampling exhausted" in ctl.error
            return
        wait_for(lambda: ctl.batches_ready >= 1)
        batch = ctl.pull_batch(1, timeout_s=5)
        assert batch.stats.groups_kept == 2 and list(batch.minibatch_groups) == [1, 1]  # one group per mini-batch
        for group in range(2):
            rewards = {s.reward for s in batch.samples if s.group == group}
            assert len(rewards) == 1  # all equal: zero advantage, no policy gradient
    finally:
        ctl.stop()


def test_a_converged_run_warns_once_every_10_steps_and_status_shows_its_pace(make_config, tmp_path, caplog):
    """Every step of a converged run exhausts dynamic sampling: the warning is logged at the 1st and the 11th
    step, the second with its count, not at each. Status has the run's total, recent reward, samples/s and ETA
    over the last 10 steps reported (Pace), and the metrics the last report carried (step_metrics)."""
    controller = {"dynamic_sampling": True, "max_gen_batches": 2, "on_exhausted": "partial"}
    cfg = load_config(make_config(controller=controller, trainer={"steps": 30}))
    ctl = started(cfg, tmp_path, ScriptedDispatcher(cfg.rollout.n, same_answers=True))
    assert ctl.status().total_steps == 30 and not ctl.status().HasField("eta_seconds")
    stats = []
    try:
        with caplog.at_level("WARNING", logger="relayrl.controller.core"):
            for step in range(1, 13):
                batch = ctl.pull_batch(step, timeout_s=10)
                stats.append(batch.stats)
                ctl.report_step(
                    controller_pb2.ReportStepRequest(
                        step=step, batch_id=batch.batch_id, policy_version=step, step_seconds=2.0 + step % 2,
                        synced_worker_ids=["w0"], metrics={"rollout_corr/kl_k1": step / 1000, "rollout_corr/ess": 1.0},
                    )
                )  # fmt: skip
        status = ctl.status()
    finally:
        ctl.stop()
    warned = [r.getMessage() for r in caplog.records if "dynamic sampling exhausted" in r.getMessage()]
    assert len(warned) == 2, warned
    assert "Step 1 " in warned[0] and "times so far" not in warned[0]
    assert "Step 11 " in warned[1] and "[11 times so far; logged once every 10]" in warned[1]
    recent = stats[2:]  # the last 10 steps
    seconds = sum(2.0 + step % 2 for step in range(3, 13))
    assert (status.trainer_step, status.total_steps, status.recent_steps) == (12, 30, 10)
    assert status.recent_reward == pytest.approx(sum(s.reward_mean for s in recent) / 10)
    assert status.samples_per_second == pytest.approx(sum(s.samples_generated for s in recent) / seconds)
    assert status.eta_seconds == pytest.approx((30 - 12) * seconds / 10)
    assert dict(status.step_metrics) == {"rollout_corr/kl_k1": pytest.approx(0.012), "rollout_corr/ess": 1.0}


class RoutedDispatcher(ScriptedDispatcher):
    """Completions with routed experts (routing replay): the right count of tokens (prompt + response - 1), except
    in the groups of every other prompt drawn, whose second sample carries one token too few (a worker's bug)."""

    def run(self, prompts, params, *, min_version, on_group=None, **_):
        result = super().run(prompts, params, min_version=min_version)
        for number, job in enumerate(prompts):
            for c in result.groups[job.prompt_id]:
                tokens = len(job.token_ids) + len(c.token_ids) - 1 - (number % 2 and c.sample_index == 1)
                c.routed_experts.CopyFrom(to_message(torch.zeros(tokens, 2, 2, dtype=torch.uint8)))
        return result


def test_a_group_whose_routed_experts_do_not_fit_its_tokens_fails_in_the_ledger_naming_them(
    make_config, tmp_path
) -> None:
    """Routing replay: a group the trainer could not replay fails with the reason in the ledger (a batch holding it
    would stop the trainer, again at each restart); the other groups make the batch, their routing in it."""
    cfg = load_config(make_config(controller={"dynamic_sampling": False}, algorithm={"routing_replay": True}))
    ctl = started(cfg, tmp_path, RoutedDispatcher(cfg.rollout.n))
    try:
        wait_for(lambda: ctl.batches_ready >= 1)
        reasons = ctl.ledger.reasons(FAILED)
        assert reasons and all(r.startswith("completion 1: routed_experts: ") for r in reasons), reasons
        assert "tokens, expected" in next(iter(reasons))
        batch = ctl.pull_batch(1, timeout_s=30)
        assert all(s.HasField("routed_experts") for s in batch.samples)
    finally:
        ctl.stop()
