"""Free TCP ports, without importing anything heavy (the launcher and the controller use it)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
