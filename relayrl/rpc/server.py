"""Building blocks of every relayrl gRPC server: error mapping, health, reflection, security, lifecycle.

Every RPC handler is wrapped so that a ``RelayError`` becomes its precise status, a bad request can
never escape as an unhandled exception, and anything unexpected is logged and answered INTERNAL —
the server keeps serving. Bytes that do not parse as the method's request message are answered
INVALID_ARGUMENT before any servicer code runs.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from relayrl.config import SecurityConfig
from relayrl.errors import RelayError
from relayrl.rpc.auth import load_token, server_credentials, server_interceptors
from relayrl.rpc.channels import message_options

log = logging.getLogger(__name__)


def _abort(context: grpc.ServicerContext, err: Exception, name: str):
    if isinstance(err, RelayError):
        context.abort(err.code, str(err))
    log.exception("unhandled error in %s", name)
    context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")


def guarded(method: Callable) -> Callable:
    """Map RelayError to its status and any other exception to INTERNAL, for unary and streaming RPCs."""
    name = method.__qualname__
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as err:  # the boundary that keeps the server alive
                _abort(context, err, name)

        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as err:
            _abort(context, err, name)

    return unary


class DecodeRequests(grpc.ServerInterceptor):
    """Answer INVALID_ARGUMENT, not INTERNAL, when a unary request's bytes are not the method's message."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode, method = handler.request_deserializer, handler_call_details.method

        def parse(raw: bytes, context: grpc.ServicerContext):
            try:
                return decode(raw)
            except Exception:  # DecodeError, invalid UTF-8 in a string field, ...
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid request message of {method}")

        if handler.response_streaming:
            stream = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(
                lambda raw, context: stream(parse(raw, context), context),
                response_serializer=handler.response_serializer,
            )
        unary = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(
            lambda raw, context: unary(parse(raw, context), context),
            response_serializer=handler.response_serializer,
        )


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


class GrpcServer:
    """A grpc.Server with Health (SERVING per service) and reflection, bound to ``address``.

    With ``security``: every call but health checks needs the bearer token (when its environment variable
    is set) and the server speaks TLS (when a certificate is configured). ``interceptors`` run outside
    the token check, so they also see refused calls.
    """

    def __init__(
        self,
        address: str,
        *,
        max_workers: int = 32,
        max_message_mib: int = 64,
        interceptors: Iterable[grpc.ServerInterceptor] = (),
        security: SecurityConfig | None = None,
        reuse_port: bool = True,
    ) -> None:
        """``reuse_port=False`` refuses a port another process serves on (gRPC sets SO_REUSEPORT by default, so
        a second server on a busy port would silently share its connections)."""
        security = security or SecurityConfig()
        if load_token(security) and not security.tls and not _is_loopback(address):
            log.warning("serving %s without TLS: the auth token travels in clear text (set security.tls_cert)", address)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
            options=message_options(max_message_mib) + ([] if reuse_port else [("grpc.so_reuseport", 0)]),
            interceptors=[*interceptors, *server_interceptors(security), DecodeRequests()],
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        credentials = server_credentials(security)
        try:
            if credentials is not None:
                self.port = self.server.add_secure_port(address, credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises "Failed to bind to address ..." for a port in use
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {address}")

    def add(self, register: Callable, servicer, descriptor) -> None:
        """Add a servicer (``register`` is the generated ``add_XServicer_to_server``)."""
        register(servicer, self.server)
        full_name = descriptor.full_name
        self._service_names.append(full_name)
        self.health.set(full_name, health_pb2.HealthCheckResponse.SERVING)

    def start(self) -> None:
        reflection.enable_server_reflection([*self._service_names, reflection.SERVICE_NAME], self.server)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.server.start()

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._service_names[1:]]:
            self.health.set(name, status)

    def stop(self, grace_s: float = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait()
