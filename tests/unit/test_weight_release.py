"""A weight update given up on. Closing a weight group from another thread ends a wait on it at once, although gloo
cannot abort the wait itself (ProcessGroupGloo keeps Backend's no-op ``abort``), and never blocks the closer on the
operation still out, nor the poster of a collective the close came in the middle of; a rollout worker whose receive
was released never serves from the memory that receive posted into, which the closed group's operations may still
write."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relayrl.models.tiny import write_tiny_model
from relayrl.rollout.hf import HFEngine
from relayrl.rollout.worker import RolloutWorker
from relayrl.v1 import rollout_pb2
from relayrl.weightsync import WeightBroadcastGroup, WeightSender, WeightSyncError, weights_checksum
from relayrl.wire.sampling import GenerationLimits
from tests.unit.engine_testing import sync_manifest

TIMEOUT_S = 60.0  # far above every bound below: a wait that ran to it would fail the test


def joined_pair(name: str) -> tuple[WeightBroadcastGroup, WeightBroadcastGroup]:
    """Rank 0 and rank 1 of one gloo group in this process, rendezvoused (their first collective, side by side)."""
    root = WeightBroadcastGroup("127.0.0.1", 0, 0, 2, name, timeout_s=TIMEOUT_S)
    member = WeightBroadcastGroup("127.0.0.1", root.port, 1, 2, name, timeout_s=TIMEOUT_S)
    meeting = threading.Thread(target=member.barrier)
    meeting.start()
    root.barrier()
    meeting.join()
    return root, member


def test_close_from_another_thread_ends_a_wait_for_bytes_that_will_not_come() -> None:
    root, member = joined_pair("close-wait")
    work = member.broadcast_async(torch.zeros(16))  # rank 0 never sends it
    closed_in: list[float] = []

    def close_later() -> None:
        time.sleep(0.3)
        began = time.monotonic()
        member.close()
        closed_in.append(time.monotonic() - began)

    closer = threading.Thread(target=close_later)
    closer.start()
    began = time.monotonic()
    with pytest.raises(WeightSyncError, match="broken or closed"):
        member.wait(work)
    waited = time.monotonic() - began
    closer.join()
    assert 0.25 < waited < 5.0  # ended by the close, not by the 60 s timeout
    assert closed_in[0] < 1.0  # the operation still out was handed to the drain, not waited for
    assert member.broken
    with pytest.raises(WeightSyncError, match="broken or closed"):
        member.broadcast_async(torch.zeros(16))  # a closed group starts nothing
    root.close()


class ClosesWhilePosting:
    """A group's gloo backend whose next broadcast is posted just after the group was closed: the interleaving of a
    close on another thread between the group's check and the post, made certain by closing on the posting thread."""

    def __init__(self, group: WeightBroadcastGroup) -> None:
        self.backend, self.group = group._pg, group

    def broadcast(self, tensors: list[torch.Tensor], options):
        self.group.close()
        return self.backend.broadcast(tensors, options)


def test_a_close_while_a_collective_is_posted_fails_it_at_once_without_waiting_it_out() -> None:
    """The closed group did not hand that operation to its drain: had the caller dropped the backend's last
    reference, gloo's destructor would have waited out the operation (TIMEOUT_S) right there."""
    root, member = joined_pair("close-post")
    member._pg = ClosesWhilePosting(member)
    began = time.monotonic()
    with pytest.raises(WeightSyncError, match="broken or closed"):
        member.broadcast_async(torch.zeros(16))  # rank 0 never sends it
    assert time.monotonic() - began < 5.0
    root.close()


def join(worker: RolloutWorker, name: str) -> WeightBroadcastGroup:
    """Trainer rank 0 of a new two-rank group ``name``, with ``worker`` as rank 1."""
    trainer = WeightBroadcastGroup("127.0.0.1", 0, 0, 2, name, timeout_s=TIMEOUT_S)
    worker.init_weight_sync(
        rollout_pb2.InitWeightSyncRequest(
            master_address="127.0.0.1", master_port=trainer.port, rank=1, world_size=2, group_name=name, timeout_s=30
        )
    )
    return trainer


def test_a_released_receive_never_lands_in_the_weights_the_worker_serves_next(tmp_path) -> None:
    engine = HFEngine(str(write_tiny_model(tmp_path / "tiny")))
    worker = RolloutWorker(engine, "w", mode="pause", limits=GenerationLimits())
    weights = {name: torch.randn_like(t) for name, t in engine.named_weights()}
    manifest = sync_manifest(weights)
    update = rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto(), group_name="first")
    first = join(worker, "first")
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            worker.update_weights(update)
        except WeightSyncError as err:
            failed.append(err)

    before = next(engine.named_weights())[1].data_ptr()
    receiving = threading.Thread(target=receive)
    receiving.start()  # the trainer sends nothing: the receive waits
    deadline = time.monotonic() + 30
    while next(engine.named_weights())[1].data_ptr() == before and time.monotonic() < deadline:
        time.sleep(0.01)  # until the parameters view the arena the receive posts into
    posted = [t.data for _, t in engine.named_weights()]  # views of that arena (not the parameters)
    worker.release_update("first")
    receiving.join(timeout=10)
    assert failed and worker.state == "torn"

    second = join(worker, "second")
    sent = threading.Thread(target=WeightSender("cpu").send, args=(second, manifest, weights))
    sent.start()
    answer = worker.update_weights(rollout_pb2.UpdateWeightsRequest(manifest=manifest.to_proto(), group_name="second"))
    sent.join(timeout=30)
    assert answer.policy_version == 1 and worker.state == "serving"
    for tensor in posted:  # a late landing of the first group's receives
        tensor.fill_(7.0)
    assert weights_checksum(engine.named_weights()) == weights_checksum(weights.items())
    for group in (first, second):
        group.close()
