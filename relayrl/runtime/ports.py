"""Free TCP ports, without importing anything heavy (the launcher and the controller use it)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10000  # below: well-known and registered services' ports
_handed_out: set[int] = set()  # none is bound when handed out: never the same one twice in a process


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (``net.ipv4.ip_local_port_range``; 32768 where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port p with p .. p+count-1 free on ``host`` now, all below the kernel's ephemeral range.

    Whoever is handed p binds it later (a role after loading its model), while every process around takes ephemeral
    ports for its connections (gRPC clients, gloo, torch's TCP store, srun): a port of that range, free when
    picked, can be taken by then. The kernel never hands out a port below the range, so only an explicit bind can
    take one of these."""
    high = ephemeral_low() - count
    rng = random.Random()
    for _ in range(1000):
        p = rng.randrange(_LOWEST, high)
        run = set(range(p, p + count))
        if not run & _handed_out and not any(port_in_use(host, q) for q in run):
            _handed_out.update(run)
            return p
    raise RuntimeError(f"no run of {count} free ports on {host} in {_LOWEST}..{high + count - 1}")


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
