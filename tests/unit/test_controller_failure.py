"""A failed run's batch production waits for a rewind instead of dying: the trainer restarted by the supervisor
rewinds the controller to its checkpoint, and production picks up from there (before, the producer thread had
returned, and the restarted trainer waited for a batch that never came)."""

from __future__ import annotations

import time

from relayrl.config import load_config
from relayrl.controller.core import Controller
from relayrl.controller.dispatch import DispatchResult
from relayrl.v1 import common_pb2, controller_pb2


class FailingOnceDispatcher:
    """Stands in for Dispatcher.run: the first call fails (a worker bug, say), later ones complete every group."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def run(self, prompts, params, *, min_version, on_group=None, **_):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("engine crashed")
        result = DispatchResult()
        for job in prompts:
            result.groups[job.prompt_id] = [
                common_pb2.Completion(
                    prompt_id=job.prompt_id, sample_index=i, token_ids=[5 + i], logprobs=[-1.0],
                    finish_reason=common_pb2.FINISH_REASON_STOP, policy_version=min_version, worker_id="w0",
                )
                for i in range(self.n)
            ]  # fmt: skip
        return result


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_failed_run_produces_again_after_a_rewind(make_config, tmp_path) -> None:
    cfg = load_config(make_config(controller={"dynamic_sampling": False}, trainer={"steps": 5}))
    ctl = Controller(cfg, state_dir=tmp_path / "state")
    ctl.dispatcher = FailingOnceDispatcher(cfg.rollout.n)
    ctl.registry.register("w0", "127.0.0.1:1", "hf", 0)
    ctl.start()
    try:
        wait_for(lambda: ctl.state == "failed")
        assert "engine crashed" in ctl.error
        ctl.rewind(controller_pb2.RewindRequest(step=0, cursor=0))  # what a restarted trainer sends
        assert ctl.state == "running" and not ctl.error
        wait_for(lambda: ctl.batches_ready >= 1)
        assert ctl.dispatcher.calls >= 2
    finally:
        ctl.stop()
