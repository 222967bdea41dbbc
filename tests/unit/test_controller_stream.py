"""The controller's side of streaming (StreamBatch): kept groups reach the trainer while the batch generates,
in the order they were kept, from verified workers only; the persisted batch is exactly what was streamed;
a batch abandoned mid-stream tells the trainer to pull again."""

from __future__ import annotations

import threading

import pytest

from relayrl.config import load_config
from relayrl.controller.core import Controller
from relayrl.controller.dispatch import DispatchResult
from relayrl.controller.ledger import PENDING, QUEUED, TRAINED
from relayrl.errors import NotFound, Unavailable
from relayrl.v1 import common_pb2, controller_pb2


class GatedDispatcher:
    """Stands in for Dispatcher.run: completes each prompt's group (last prompt first) when the test allows."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.gate = threading.Semaphore(0)
        self.only: list = []
        self.stop = threading.Event()

    def run(self, prompts, params, *, min_version, on_group=None, should_stop=lambda: False, only=None, **_):
        self.only.append(only)
        result = DispatchResult()
        for job in reversed(prompts):  # arrival order differs from dataset order
            while not self.gate.acquire(timeout=0.1):
                if should_stop() or self.stop.is_set():
                    result.failed.update({j.prompt_id: "stopped" for j in prompts if j.prompt_id not in result.groups})
                    return result
            group = [
                common_pb2.Completion(
                    prompt_id=job.prompt_id,
                    sample_index=i,
                    token_ids=[5 + i],
                    logprobs=[-1.0],
                    finish_reason=common_pb2.FINISH_REASON_STOP,
                    policy_version=min_version,
                    worker_id="w0",
                )
                for i in range(self.n)
            ]
            result.groups[job.prompt_id] = group
            if on_group is not None:
                on_group(job.prompt_id, group)
        return result


@pytest.fixture
def controller(make_config, tmp_path):
    cfg = load_config(make_config(controller={"dynamic_sampling": False}, trainer={"steps": 5, "stream": "auto"}))
    assert cfg.streams
    ctl = Controller(cfg, state_dir=tmp_path / "state")
    ctl.dispatcher = GatedDispatcher(cfg.rollout.n)
    ctl.registry.register("w0", "127.0.0.1:1", "hf", 0)
    ctl.registry.register("joiner", "127.0.0.1:2", "hf", 0)
    # the trainer's first publish: w0's load of version 0 was verified
    ctl.report_weight_sync(controller_pb2.ReportWeightSyncRequest(synced_worker_ids=["w0"], reason="initial"))
    yield ctl
    ctl.dispatcher.stop.set()
    ctl.stop()


def test_groups_stream_as_they_are_kept_and_the_batch_is_what_was_streamed(controller) -> None:
    groups = controller.cfg.controller.train_batch_groups
    controller.start()
    parts = controller.stream_batch(1, timeout_s=60)
    controller.dispatcher.gate.release()  # one group done, the rest still generating
    first = next(parts)
    assert first.streamed and [s.group for s in first.samples] == [0] * controller.cfg.rollout.n
    assert controller.batches_ready == 0  # the batch is not complete
    controller.dispatcher.gate.release(groups - 1)
    rest = list(parts)
    header = rest[-1].batch
    streamed = [s for part in [first, *rest[:-1]] for s in part.samples]
    assert rest[-1].HasField("batch") and not header.samples
    assert controller.dispatcher.only == [frozenset({"w0"})]  # not the joiner: its load was not verified
    persisted = controller_pb2.Batch.FromString((controller.state_dir / "batches" / "step_1.pb").read_bytes())
    assert list(persisted.samples) == streamed  # exactly what the trainer trained
    assert persisted.batch_id == header.batch_id and list(header.minibatch_groups) == [2, 2]
    drawn = [controller.dataset.record(d).prompt_id for d in range(groups)]
    assert [s.prompt_id for s in streamed[:: controller.cfg.rollout.n]] == drawn[::-1]  # kept (arrival) order
    assert all(controller.ledger.state(pid)[0] == QUEUED for pid in drawn)


def test_a_batch_abandoned_mid_stream_asks_the_trainer_to_pull_again(controller) -> None:
    controller.start()
    parts = controller.stream_batch(1, timeout_s=60)
    controller.dispatcher.gate.release()
    assert next(parts).samples
    controller.dispatcher.stop.set()  # the controller shuts down mid-generation
    controller._stop.set()
    with pytest.raises(Unavailable, match="abandoned mid-stream; pull the step again"):
        next(parts)
    drawn = controller.dataset.record(0).prompt_id
    assert controller.ledger.state(drawn)[0] != PENDING  # failed, with its reason: nothing lost silently


def test_a_restart_never_redraws_prompts_drawn_before_the_crash(make_config, tmp_path) -> None:
    """A kill between a draw's ledger entry and the cursor's save: the restarted controller moves the cursor past
    those prompts and fails them (with the reason) instead of drawing them again."""
    cfg = load_config(make_config())
    first = Controller(cfg, state_dir=tmp_path / "state")
    drawn = [first.dataset.record(d).prompt_id for d in range(3)]
    first.ledger.mark(drawn, PENDING)  # ...and the process dies before state.json records the new cursor
    first.ledger.close()
    second = Controller(cfg, state_dir=tmp_path / "state")
    try:
        assert second.progress.cursor == 3
        assert all(second.ledger.state(pid)[:2] == ("failed", "controller restarted before the prompt was trained")
                   for pid in drawn)  # fmt: skip
    finally:
        second.ledger.close()


def pulled(controller) -> controller_pb2.Batch:
    """Step 1's batch, built and pulled."""
    controller.start()
    controller.dispatcher.gate.release(controller.cfg.controller.train_batch_groups)
    return controller.pull_batch(1, timeout_s=60)


def stopped(controller) -> None:
    """The controller stops, its state on disk as a killed one leaves it."""
    controller.dispatcher.stop.set()
    controller.stop()


def test_a_restart_after_a_batch_was_built_keeps_it_and_draws_after_it(controller, tmp_path) -> None:
    """A built batch is persisted, the cursor is saved only with the step's report: a controller restarted before
    that report hands out the same batch, keeps its prompts pending and draws from where the batch ended."""
    groups = controller.cfg.controller.train_batch_groups
    batch = pulled(controller)
    stopped(controller)
    second = Controller(controller.cfg, state_dir=tmp_path / "state")
    try:
        assert second.pull_batch(1, timeout_s=5) == batch
        assert second.progress.cursor == batch.stats.cursor_end == groups
        assert all(second.ledger.state(s.prompt_id)[0] == QUEUED for s in batch.samples)
    finally:
        second.ledger.close()


def test_a_report_whose_answer_was_lost_is_answered_again_by_the_restarted_controller(controller, tmp_path) -> None:
    """The controller records a ReportStep and is killed before it answers; the trainer repeats the report to the
    restarted controller, which answers it (the trainer must not die of it) and trains nothing twice."""
    batch = pulled(controller)
    report = controller_pb2.ReportStepRequest(step=1, batch_id=batch.batch_id, policy_version=1)
    controller.report_step(report)
    stopped(controller)
    second = Controller(controller.cfg, state_dir=tmp_path / "state")
    try:
        second.report_step(report)
        assert second.progress.trainer_step == 1
        assert all(second.ledger.state(s.prompt_id)[0] == TRAINED for s in batch.samples)
        with pytest.raises(NotFound, match="batch_id"):  # another batch id for that step is still refused
            second.report_step(controller_pb2.ReportStepRequest(step=1, batch_id="other", policy_version=1))
    finally:
        second.ledger.close()


def test_a_kill_between_a_recorded_report_and_its_ledger_entries_is_settled_on_restart(controller, tmp_path) -> None:
    """state.json is the report's commit point: a controller killed after saving it and before marking the batch's
    prompts TRAINED (and deleting the batch's file) finishes both on restart, instead of failing trained prompts."""
    batch = pulled(controller)
    stopped(controller)
    controller.progress.trainer_step, controller.progress.last_batch_id = 1, batch.batch_id
    controller._save_progress()  # ...and the process dies here
    second = Controller(controller.cfg, state_dir=tmp_path / "state")
    try:
        assert all(second.ledger.state(s.prompt_id)[0] == TRAINED for s in batch.samples)
        assert not list((tmp_path / "state" / "batches").glob("step_1.*"))
        second.report_step(controller_pb2.ReportStepRequest(step=1, batch_id=batch.batch_id, policy_version=1))
    finally:
        second.ledger.close()
