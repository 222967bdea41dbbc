"""Closing a weight group from another thread ends a wait on it at once, although gloo cannot abort the wait
itself (ProcessGroupGloo keeps Backend's no-op ``abort``), and never blocks the closer on the operation still out."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relayrl.weightsync import WeightBroadcastGroup, WeightSyncError

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
