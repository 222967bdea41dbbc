"""How a client reaches the controller: address, credentials, deadlines and retries.

Resolution order for every setting: the explicit argument, then the environment
(``RELAYRL_CONTROLLER``, ``RELAYRL_AUTH_TOKEN``, ``RELAYRL_TLS_CA``, ``RELAYRL_TLS_CERT``,
``RELAYRL_TLS_KEY``, ``RELAYRL_TLS_SERVER_NAME``), then the default. The token is sent on every call as
``authorization: Bearer <token>`` metadata and is never part of ``repr``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from relayrl.rpc.channels import message_options
from relayrl.rpc.retry import RetryPolicy
from relayrl.runtime.address import AddressError, parse_address, recorded_address

ENV_ADDRESS = "RELAYRL_CONTROLLER"
ENV_TOKEN = "RELAYRL_AUTH_TOKEN"
ENV_TLS = {
    "root_certificates": "RELAYRL_TLS_CA",
    "certificate_chain": "RELAYRL_TLS_CERT",
    "private_key": "RELAYRL_TLS_KEY",
}
ENV_SERVER_NAME = "RELAYRL_TLS_SERVER_NAME"


class ClientConfigError(ValueError):
    """A client setting is missing or unusable; the message names it (never a secret's value)."""


def _read(path: str | Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ClientConfigError(f"{path}: cannot read: {err.strerror}") from None


@dataclass(frozen=True)
class ClientOptions:
    """Connection settings. ``timeout_s`` is the default deadline of one call (retries included);
    ``submit_timeout_s`` the default of a whole SubmitPrompts stream. ``attempts`` counts tries of a call
    that fails with a retryable code (relayrl/rpc/retry.py: UNAVAILABLE, DEADLINE_EXCEEDED of one try), waiting
    ``backoff_s`` x 2^k (at most ``max_backoff_s``, with jitter)."""

    address: str
    token: str | None = field(default=None, repr=False)
    root_certificates: bytes | None = field(default=None, repr=False)
    certificate_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None
    timeout_s: float = 30.0
    submit_timeout_s: float = 600.0
    attempts: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    max_message_mib: int = 64

    @classmethod
    def resolve(
        cls,
        address: str | Path | None = None,
        *,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        server_name: str | None = None,
        **settings,
    ) -> ClientOptions:
        """Arguments first, then the environment. ``address``: ``host:port``, or a run directory ``relayrl up``
        started (``runs/NAME``: the address it recorded in ``controller.address``). TLS is on when a CA or a client
        certificate is given."""
        field = "address" if address else ENV_ADDRESS
        address = str(address or os.environ.get(ENV_ADDRESS) or "")
        if not address:
            raise ClientConfigError(f"controller address: pass host:port or a run directory, or set {ENV_ADDRESS}")
        try:
            if field == "address" and Path(address).is_dir():
                address = str(recorded_address(address, field))
            address = str(parse_address(address, field))  # strictly: no scheme, a port in range
        except AddressError as err:
            raise ClientConfigError(str(err)) from None
        files = {
            "root_certificates": tls_ca or os.environ.get(ENV_TLS["root_certificates"]),
            "certificate_chain": tls_cert or os.environ.get(ENV_TLS["certificate_chain"]),
            "private_key": tls_key or os.environ.get(ENV_TLS["private_key"]),
        }
        if bool(files["certificate_chain"]) != bool(files["private_key"]):
            raise ClientConfigError("client certificate and key must be given together (--tls-cert, --tls-key)")
        options = cls(
            address=address,
            token=token or os.environ.get(ENV_TOKEN) or None,
            server_name=server_name or os.environ.get(ENV_SERVER_NAME) or None,
            **{key: _read(path) for key, path in files.items()},
            **settings,
        )
        if options.attempts < 1:
            raise ClientConfigError(f"attempts: must be >= 1, got {options.attempts}")
        return options

    @property
    def tls(self) -> bool:
        return self.root_certificates is not None or self.certificate_chain is not None

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials (system roots when no CA is given), or None for plaintext."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )

    def open_channel(self, transport):
        """A channel to ``address`` from ``transport``: the ``grpc`` module (sync) or ``grpc.aio``; both
        expose ``insecure_channel`` / ``secure_channel`` with the same arguments."""
        credentials = self.credentials()
        if credentials is None:
            return transport.insecure_channel(self.address, options=self.channel_options())
        return transport.secure_channel(self.address, credentials, options=self.channel_options())

    def channel_options(self) -> list[tuple[str, object]]:
        options: list[tuple[str, object]] = list(message_options(self.max_message_mib))
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def retry(self) -> RetryPolicy:
        """The SDK's settings of the one retry policy (relayrl/rpc/retry.py): +-20 % jitter on each wait."""
        return RetryPolicy(self.backoff_s, self.max_backoff_s, attempts=self.attempts, jitter=0.2)
