"""Authentication of relayrl's gRPC connections: a bearer token on every call, TLS or mTLS underneath.

Servers check the ``authorization: Bearer <token>`` metadata of every call (constant-time comparison) and
answer UNAUTHENTICATED otherwise. ``grpc.health.v1.Health`` stays open so that load balancers and
Kubernetes probes need no secret; server reflection is *not* open (it describes every RPC, which is an
attacker's map): pass the token to grpcurl with ``-H "authorization: Bearer $RELAYRL_AUTH_TOKEN"``.
Clients attach the token with a channel interceptor, so it also travels on plaintext channels; use TLS
(``security.tls_cert``) whenever a call leaves the host. The token is never logged or echoed.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from relayrl.config import ConfigError, SecurityConfig

log = logging.getLogger(__name__)

OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
MIN_TOKEN_CHARS = 16


def load_token(cfg: SecurityConfig) -> str | None:
    """The token from ``cfg.auth_token_env``; None when unset or empty (authentication off).

    Raises ConfigError naming the variable, never the value, for a token too short or not a header value.
    """
    token = os.environ.get(cfg.auth_token_env, "").strip()
    if not token:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{cfg.auth_token_env}: the auth token needs at least {MIN_TOKEN_CHARS} characters")
    if not all(33 <= ord(c) < 127 for c in token):
        raise ConfigError(f"{cfg.auth_token_env}: the auth token must be printable ASCII without spaces")
    return token


def _read(cfg: SecurityConfig, key: str) -> bytes | None:
    path = getattr(cfg, key)
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"security.{key}: cannot read {path}: {err.strerror}") from None


# -- server side -----------------------------------------------------------------------------------
def server_credentials(cfg: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for a server (client certificates required with ``require_client_cert``); None: plaintext."""
    if not cfg.tls:
        return None
    return grpc.ssl_server_credentials(
        [(_read(cfg, "tls_key"), _read(cfg, "tls_cert"))],
        root_certificates=_read(cfg, "tls_ca"),
        require_client_auth=cfg.require_client_cert,
    )


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuse every call without ``authorization: Bearer <token>`` (UNAUTHENTICATED), except open services."""

    def __init__(self, token: str, open_services: frozenset[str] = OPEN_SERVICES) -> None:
        self._expected = f"Bearer {token}".encode()
        self._open = open_services

    def intercept_service(self, continuation, handler_call_details):
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if service in self._open:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if self._authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _refusal(handler, handler_call_details.method)

    def _authorized(self, metadata) -> bool:
        values = [m.value for m in metadata if m.key == "authorization"]
        if len(values) != 1:
            return False
        value = values[0].encode() if isinstance(values[0], str) else values[0]
        return hmac.compare_digest(value, self._expected)


def _refusal(handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED without reading the request."""

    def refuse(_request, context: grpc.ServicerContext):
        log.warning("refused %s from %s: no valid bearer token", method, context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token (metadata authorization: Bearer)")

    if handler is not None and handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def server_interceptors(cfg: SecurityConfig) -> list[grpc.ServerInterceptor]:
    """The token check when a token is configured, else nothing."""
    token = load_token(cfg)
    return [TokenAuthInterceptor(token)] if token else []


# -- client side -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientSecurity:
    """How a client connects: the token it sends and the TLS credentials it uses (None: plaintext)."""

    token: str | None = None
    credentials: grpc.ChannelCredentials | None = None
    server_name: str | None = None

    @classmethod
    def from_config(cls, cfg: SecurityConfig) -> ClientSecurity:
        credentials = None
        if cfg.tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(cfg, "tls_ca"),
                private_key=_read(cfg, "tls_key"),
                certificate_chain=_read(cfg, "tls_cert"),
            )
        return cls(load_token(cfg), credentials, cfg.tls_server_name)


class _CallDetails(
    collections.namedtuple("_CallDetails", "method timeout metadata credentials wait_for_ready compression"),
    grpc.ClientCallDetails,
):
    pass


class BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != "authorization"]
        return _CallDetails(
            details.method,
            details.timeout,
            [*metadata, self._header],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)
