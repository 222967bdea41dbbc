"""``EnvironmentServer``: an ``Environment`` class served over EnvironmentService (``relayrl env serve``).

One process holds its sessions in memory (relayrl/env/sessions.py), so a session lives in the process that
answered its Reset: a pool of processes is a list of addresses, one per process, and a caller keeps each episode
on the server it reset it on. The server adds what every relayrl server has (relayrl/rpc/server.py):
grpc.health.v1, reflection, the bearer token and TLS of ``security``, INVALID_ARGUMENT for bytes that are not
the request message, and an error status (never a dead server) for anything an environment raises.
"""

from __future__ import annotations

import logging

from relayrl.config import ConfigError, SecurityConfig
from relayrl.env.base import Environment
from relayrl.env.sessions import SessionTable
from relayrl.imports import SpecImportError, import_attr
from relayrl.rpc.server import GrpcServer, guarded
from relayrl.v1 import environment_pb2 as pb
from relayrl.v1 import environment_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class EnvironmentServicer(pb_grpc.EnvironmentServiceServicer):
    """The four RPCs over a session table; each call's gRPC deadline is the environment's deadline, and a call
    the client cancels cancels an async environment method (``context.add_callback`` runs when the RPC ends)."""

    def __init__(self, table: SessionTable) -> None:
        self.table = table

    @guarded
    def Reset(self, request, context):
        return self.table.reset(request, context.time_remaining(), context.add_callback)

    @guarded
    def Step(self, request, context):
        return self.table.step(request, context.time_remaining(), context.add_callback)

    @guarded
    def Close(self, request, context):
        return self.table.close(request, context.time_remaining())

    @guarded
    def Info(self, request, context):
        return self.table.info()


def load_environment(spec: str) -> type[Environment]:
    """The class named by ``module:Class`` (ConfigError naming ``spec`` when it is not an Environment). The working
    directory is searched too, as ``python -m`` would (the ``relayrl`` script alone does not put it on sys.path)."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ConfigError(f"environment {spec!r}: expected module:Class (e.g. relayrl.env.examples.guess:GuessNumber)")
    try:
        cls = import_attr(spec, "environment")
    except SpecImportError as err:
        raise ConfigError(str(err)) from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(
            f"environment {spec!r}: {class_name} is not a relayrl.env.Environment subclass in {module_name}"
        )
    return cls


class EnvironmentServer:
    """``env_class`` served at ``host:port`` (0: any free port; ``port`` is the bound one after construction).

    ``max_sessions``: sessions held at once (0: no limit; Reset answers RESOURCE_EXHAUSTED beyond);
    ``idle_timeout_s``: a session idle this long is closed and forgotten."""

    def __init__(
        self,
        env_class: type[Environment],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_sessions: int = 64,
        idle_timeout_s: float = 600.0,
        security: SecurityConfig | None = None,
    ) -> None:
        threads = (max_sessions or 64) + 8  # every session can have a call waiting, plus Info and Close
        self.table = SessionTable(
            env_class,
            max_sessions=max_sessions,
            idle_timeout_s=idle_timeout_s,
            workers=threads,
            name=env_class.name or env_class.__name__,
        )
        self.grpc = GrpcServer(f"{host}:{port}", max_workers=threads, security=security, reuse_port=False)
        self.grpc.add(
            pb_grpc.add_EnvironmentServiceServicer_to_server,
            EnvironmentServicer(self.table),
            pb.DESCRIPTOR.services_by_name["EnvironmentService"],
        )
        self.port = self.grpc.port
        self.address = f"{'127.0.0.1' if host in ('0.0.0.0', '[::]', '') else host}:{self.port}"

    def start(self) -> EnvironmentServer:
        self.grpc.start()
        self.table.start_reaper()
        log.info("environment %s serving on %s", self.table.name, self.address)
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop answering (calls in flight get ``grace_s``), then close every session."""
        self.grpc.stop(grace_s)
        self.table.shutdown()
