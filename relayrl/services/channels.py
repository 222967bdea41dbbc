"""gRPC channel and server options shared by every relayrl process."""

from __future__ import annotations

import grpc

MIB = 1 << 20


def message_options(max_message_mib: int = 64) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_mib * MIB),
        ("grpc.max_receive_message_length", max_message_mib * MIB),
    ]


def open_channel(address: str, options: list | None = None, credentials: grpc.ChannelCredentials | None = None):
    """An insecure or TLS channel to ``address`` with relayrl's message-size options."""
    opts = (options or []) + message_options() + [("grpc.enable_retries", 1)]
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=opts)
    return grpc.insecure_channel(address, options=opts)
