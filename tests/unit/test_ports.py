"""relayrl.runtime.ports: ports handed to a process that binds them later."""

from __future__ import annotations

import socket

from relayrl.runtime.ports import ephemeral_low, free_port, port_in_use


def test_free_ports_are_runs_below_the_ephemeral_range_never_handed_out_twice() -> None:
    low = ephemeral_low()
    starts = [free_port(count=3) for _ in range(50)]
    runs = [set(range(p, p + 3)) for p in starts]
    assert all(p + 2 < low for p in starts), (starts, low)
    assert len(set().union(*runs)) == 3 * len(runs)  # disjoint: none is bound yet, so none may repeat
    assert not any(port_in_use("127.0.0.1", q) for run in runs for q in run)


def test_a_port_in_use_says_why_and_a_free_one_says_nothing() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        assert port_in_use("127.0.0.1", busy) == "Address already in use"
    assert port_in_use("127.0.0.1", free_port()) is None
