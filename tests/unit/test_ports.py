"""relayrl.runtime.ports: ports handed to a process that binds them later."""

from __future__ import annotations

import socket

import pytest

from relayrl.runtime.ports import ephemeral_range, free_port, port_in_use


def test_free_ports_are_runs_outside_the_ephemeral_range_never_handed_out_twice() -> None:
    low, high = ephemeral_range()
    starts = [free_port(count=3) for _ in range(50)]
    runs = [set(range(p, p + 3)) for p in starts]
    assert all(p + 2 < low or p > high for p in starts), (starts, low, high)
    assert len(set().union(*runs)) == 3 * len(runs)  # disjoint: none is bound yet, so none may repeat
    assert not any(port_in_use("127.0.0.1", q) for run in runs for q in run)


def test_a_port_in_use_says_why_and_a_free_one_says_nothing() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        assert port_in_use("127.0.0.1", busy) == "Address already in use"
    assert port_in_use("127.0.0.1", free_port()) is None


def test_with_no_room_below_the_ephemeral_range_ports_come_from_above_it(monkeypatch) -> None:
    from relayrl.runtime import ports

    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 60999))  # e.g. a host that widened the range
    assert all(61000 <= free_port(count=2) <= 65534 for _ in range(20))
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    with pytest.raises(RuntimeError, match=r"no run of 1 free ports on 127\.0\.0\.1 outside the ephemeral range 1024-"):
        free_port()
