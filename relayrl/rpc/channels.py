"""gRPC channel and server options shared by every relayrl process, and how clients authenticate.

A process's client security (token, TLS) is configured once from its config (``configure_client``);
every ``open_channel`` uses it unless given another. Unconfigured, clients send the token found in
``RELAYRL_AUTH_TOKEN`` (if any) over plaintext.
"""

from __future__ import annotations

import grpc

from relayrl.config import SecurityConfig
from relayrl.rpc.auth import BearerToken, ClientSecurity

MIB = 1 << 20

_configured: ClientSecurity | None = None


def message_options(max_message_mib: int = 64) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_mib * MIB),
        ("grpc.max_receive_message_length", max_message_mib * MIB),
    ]


def configure_client(cfg: SecurityConfig | None) -> None:
    """Make ``cfg`` this process's client security (token from its environment variable, TLS files);
    None goes back to the unconfigured default."""
    global _configured
    _configured = None if cfg is None else ClientSecurity.from_config(cfg)


def client_security() -> ClientSecurity:
    """The configured client security, or the token of ``RELAYRL_AUTH_TOKEN`` over plaintext."""
    return _configured or ClientSecurity.from_config(SecurityConfig())


# A server that restarts (the controller, a supervised environment server or worker) is reached again within ~2 s,
# not after gRPC's default reconnect backoff, which grows to two minutes while it is down: every channel's default.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]


def _channel_options(options: list | None, security: ClientSecurity) -> list:
    opts = (options or []) + message_options() + [("grpc.enable_retries", 1)]
    given = {key for key, _ in opts}
    opts += [option for option in FAST_RECONNECT if option[0] not in given]
    if security.server_name:
        opts.append(("grpc.ssl_target_name_override", security.server_name))
    return opts


def open_channel(address: str, options: list | None = None, security: ClientSecurity | None = None) -> grpc.Channel:
    """A plaintext or TLS channel to ``address`` with relayrl's message-size options and the bearer token."""
    security = security or client_security()
    opts = _channel_options(options, security)
    if security.credentials is not None:
        channel = grpc.secure_channel(address, security.credentials, options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    return grpc.intercept_channel(channel, BearerToken(security.token)) if security.token else channel


def open_aio_channel(
    address: str, options: list | None = None, security: ClientSecurity | None = None
) -> tuple[grpc.aio.Channel, tuple[tuple[str, str], ...]]:
    """``open_channel`` for asyncio: a ``grpc.aio`` channel (create it inside the event loop that uses it) and the
    metadata every call on it must send (the bearer token; aio channels take no interceptor of ours)."""
    security = security or client_security()
    opts = _channel_options(options, security)
    if security.credentials is not None:
        channel = grpc.aio.secure_channel(address, security.credentials, options=opts)
    else:
        channel = grpc.aio.insecure_channel(address, options=opts)
    return channel, (("authorization", f"Bearer {security.token}"),) if security.token else ()
