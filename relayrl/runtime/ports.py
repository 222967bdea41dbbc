"""Free TCP ports, without importing anything heavy (the launcher and the controller use it)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10000  # below: well-known and registered services' ports
_handed_out: set[int] = set()  # none is bound when handed out: never the same one twice in a process


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral ports, first and last (``net.ipv4.ip_local_port_range``; 32768-60999 where unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port p with p .. p+count-1 free on ``host`` now, all outside the kernel's ephemeral range: from 10000 up to
    it, or above it.

    Whoever is handed p binds it later (a role after loading its model), while every process around takes ephemeral
    ports for its connections (gRPC clients, gloo, torch's TCP store, srun): a port of that range, free when
    picked, can be taken by then. The kernel never hands out a port outside the range, so only an explicit bind can
    take one of these."""
    low, high = ephemeral_range()
    starts = [*range(_LOWEST, low - count + 1), *range(high + 1, 65536 - count + 1)]
    rng = random.Random()  # its own generator: a run's seeding of `random` must not make two processes pick alike
    for _ in range(1000 if starts else 0):
        p = rng.choice(starts)
        run = set(range(p, p + count))
        if not run & _handed_out and not any(port_in_use(host, q) for q in run):
            _handed_out.update(run)
            return p
    raise RuntimeError(f"no run of {count} free ports on {host} outside the ephemeral range {low}-{high}")


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (e.g. "Address already in use"), or None when it can. Connections in
    TIME_WAIT do not count (SO_REUSEADDR, which servers set too): a server restarted on its port gets it back."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as err:
            return err.strerror or str(err)
    return None
