"""Addresses and ports, parsed once and strictly for every CLI flag, environment variable and config key.

An address is ``host:port`` (``[v6]:port`` for an IPv6 literal): no scheme (gRPC dials ``http://h:p`` as a
name to resolve), a port always (gRPC dials ``localhost`` on 443), a port in 1..65535 (a larger one would
wrap). Every error is an ``AddressError`` whose message starts with the field it came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MAX_PORT = 65535
_HOST = re.compile(r"^[A-Za-z0-9._-]+$")  # a DNS name or an IPv4 literal
_V6 = re.compile(r"^[0-9A-Fa-f:.]+$")


class AddressError(ValueError):
    """A bad address or port: ``"<field>: <reason>"``, the field being a flag, variable or config key."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_port(text: str | int, field: str, *, any_port: bool = False) -> int:
    """A port in 1..65535 (0 too with ``any_port``: the system picks one)."""
    low = 0 if any_port else 1
    value = str(text).strip()
    if not value.isdigit():
        raise AddressError(field, f"port {text!r} is not a number ({low}..{MAX_PORT})")
    port = int(value)
    if not low <= port <= MAX_PORT:
        raise AddressError(field, f"port {port} is out of range {low}..{MAX_PORT}")
    return port


def parse_host(text: str, field: str) -> str:
    """A host alone (a name, an IPv4 or IPv6 literal): AddressError naming ``field`` for a scheme or a port."""
    value = text.strip()
    if "://" in value:
        raise AddressError(field, f"{text!r} has a scheme ({value.split('://', 1)[0]}://); give the host alone")
    if _HOST.match(value) or (value.count(":") >= 2 and _V6.match(value.strip("[]"))):
        return value
    raise AddressError(field, f"{text!r} is not a host name or IP address (the port is a key of its own)")


def parse_address(text: str, field: str) -> Address:
    """``host:port`` -> Address; AddressError naming ``field`` for a scheme, a missing host or port, a bad port."""
    value = text.strip()
    if "://" in value:
        scheme = value.split("://", 1)[0]
        raise AddressError(field, f"{text!r} has a scheme ({scheme}://); give host:port, e.g. 127.0.0.1:50051")
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep or not _V6.match(host):
            raise AddressError(field, f"{text!r} is not [ipv6]:port")
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            raise AddressError(field, f"{text!r} has no port; give host:port, e.g. {value or '127.0.0.1'}:50051")
        if not _HOST.match(host):
            raise AddressError(field, f"{text!r} has no valid host; give host:port, e.g. 127.0.0.1:{port}")
    return Address(host, parse_port(port, field))


def recorded_address(run_dir: str | Path, field: str) -> Address:
    """The controller address ``relayrl up`` wrote into ``<run_dir>/controller.address``; AddressError naming
    ``field`` when the directory has none, naming the file when it holds a bad one."""
    recorded = Path(run_dir) / "controller.address"
    if not recorded.is_file():
        raise AddressError(field, f"{run_dir} has no controller.address (is it a run `relayrl up` started?)")
    return parse_address(recorded.read_text(), str(recorded))
