"""Clients of an environment: ``EnvironmentClient`` over gRPC, ``LocalEnvironmentClient`` in-process,
``AsyncEnvironmentClient`` over grpc.aio and ``AsyncLocalEnvironmentClient`` in-process (the same calls as
coroutines: what the episode loop awaits).

Both have one thread-safe sync API in chat-template dicts (relayrl/env/messages.py)::

    reset(session_id, task, seed) -> Reset        step(session_id, action) -> Step
    close(session_id, reason="") -> float | None  info() -> {"name", "max_sessions", "sessions"}

and both report every failure as ``EnvError`` (``code``: the gRPC status; ``deadline``: the call ran past
``timeout_s``). The local client runs the same session table as ``relayrl env serve`` (relayrl/env/sessions.py)
and converts every request and answer to the proto messages and back, so an environment behaves the same
in a test as behind a server.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc

from relayrl.config import SecurityConfig
from relayrl.env.base import Environment
from relayrl.env.messages import message_to_proto, messages_from_proto, tools_from_proto
from relayrl.env.sessions import SessionTable
from relayrl.env.types import EnvError, Reset, Step
from relayrl.errors import InvalidArgument, RelayError
from relayrl.rpc.auth import ClientSecurity
from relayrl.rpc.channels import open_aio_channel, open_channel
from relayrl.v1 import environment_pb2 as pb
from relayrl.v1 import environment_pb2_grpc as pb_grpc


def _task_text(task: dict) -> str:
    if not isinstance(task, dict):
        raise EnvError(grpc.StatusCode.INVALID_ARGUMENT, f"task: must be a dict, got {type(task).__name__}")
    try:
        return json.dumps(task, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise EnvError(grpc.StatusCode.INVALID_ARGUMENT, f"task: not JSON-serialisable ({err})") from None


def _answer(convert: Callable):
    """``convert()``; an answer that does not convert is an EnvError without a status."""
    try:
        return convert()
    except InvalidArgument as err:
        raise EnvError(None, f"the environment answered an invalid message: {err}") from None


def reset_request(session_id: str, task: dict, seed: int | None) -> pb.ResetRequest:
    request = pb.ResetRequest(session_id=session_id, task=_task_text(task))
    if seed is not None:
        request.seed = seed
    return request


def reset_answer(response: pb.ResetResponse) -> Reset:
    return _answer(
        lambda: Reset(messages_from_proto(response.messages, "messages"), tools_from_proto(response.tools, "tools"))
    )


def step_request(session_id: str, action: dict) -> pb.StepRequest:
    try:
        message = message_to_proto(action, "action")
    except InvalidArgument as err:
        raise EnvError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
    return pb.StepRequest(session_id=session_id, action=message)


def step_answer(response: pb.StepResponse) -> Step:
    return Step(
        observations=_answer(lambda: messages_from_proto(response.observations, "observations")),
        reward=response.reward if response.HasField("reward") else None,
        done=response.done,
        truncated=response.truncated,
        metrics=dict(response.metrics),
    )


def close_answer(response: pb.CloseResponse) -> float | None:
    return response.reward if response.HasField("reward") else None


def info_answer(response: pb.InfoResponse) -> dict:
    return {"name": response.name, "max_sessions": response.max_sessions, "sessions": response.sessions}


class _EnvironmentCalls:
    """The API in dicts over ``_call(method, request)``, which answers the proto response or raises EnvError."""

    def _call(self, method: str, request):
        raise NotImplementedError

    def reset(self, session_id: str, task: dict, seed: int | None = None) -> Reset:
        return reset_answer(self._call("Reset", reset_request(session_id, task, seed)))

    def step(self, session_id: str, action: dict) -> Step:
        return step_answer(self._call("Step", step_request(session_id, action)))

    def close(self, session_id: str, reason: str = "") -> float | None:
        return close_answer(self._call("Close", pb.CloseRequest(session_id=session_id, reason=reason)))

    def info(self) -> dict:
        return info_answer(self._call("Info", pb.InfoRequest()))


class EnvironmentClient(_EnvironmentCalls):
    """An ``EnvironmentService`` at ``address`` (host:port); every call has the deadline ``timeout_s``.

    ``security``: a SecurityConfig or ClientSecurity (token, TLS); None: this process's configured client
    security (relayrl/rpc/channels.py)."""

    def __init__(
        self, address: str, *, timeout_s: float, security: SecurityConfig | ClientSecurity | None = None
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        if isinstance(security, SecurityConfig):
            security = ClientSecurity.from_config(security)
        self.address, self.timeout_s = address, timeout_s
        self._channel = open_channel(address, security=security)
        self._stub = pb_grpc.EnvironmentServiceStub(self._channel)

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise EnvError(err.code(), err.details() or "") from None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the channel connects; EnvError(UNAVAILABLE) after ``timeout_s``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise EnvError(grpc.StatusCode.UNAVAILABLE, f"{self.address}: not reachable within {timeout_s} s") from None

    def disconnect(self) -> None:
        """Close the channel (sessions on the server stay until closed or expired)."""
        self._channel.close()

    def __enter__(self) -> EnvironmentClient:
        return self

    def __exit__(self, *exc) -> None:
        self.disconnect()


class AsyncEnvironmentClient:
    """``EnvironmentClient``'s API as coroutines over ``grpc.aio`` (create it inside the event loop that awaits it).
    Each call's deadline is ``timeout_s``; every failure is an ``EnvError``."""

    def __init__(self, address: str, *, timeout_s: float, security: ClientSecurity | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.address, self.timeout_s = address, timeout_s
        self._channel, self._metadata = open_aio_channel(address, security=security)
        self._stub = pb_grpc.EnvironmentServiceStub(self._channel)

    async def _call(self, method: str, request):
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise EnvError(err.code(), err.details() or "") from None

    async def reset(self, session_id: str, task: dict, seed: int | None = None) -> Reset:
        return reset_answer(await self._call("Reset", reset_request(session_id, task, seed)))

    async def step(self, session_id: str, action: dict) -> Step:
        return step_answer(await self._call("Step", step_request(session_id, action)))

    async def close(self, session_id: str, reason: str = "") -> float | None:
        return close_answer(await self._call("Close", pb.CloseRequest(session_id=session_id, reason=reason)))

    async def info(self) -> dict:
        return info_answer(await self._call("Info", pb.InfoRequest()))

    async def disconnect(self) -> None:
        await self._channel.close()


class LocalEnvironmentClient(_EnvironmentCalls):
    """``env_class(**env_kwargs)`` per session, run in this process by the session table a server uses.

    ``timeout_s``: each call's deadline (None: none); ``max_sessions`` (0: no limit) and ``idle_timeout_s`` as
    for ``relayrl env serve``."""

    def __init__(
        self,
        env_class: type[Environment],
        *,
        timeout_s: float | None = None,
        max_sessions: int = 0,
        idle_timeout_s: float = 600.0,
        **env_kwargs,
    ) -> None:
        self.timeout_s = timeout_s
        self.table = SessionTable(
            lambda: env_class(**env_kwargs),
            max_sessions=max_sessions,
            idle_timeout_s=idle_timeout_s,
            name=env_class.name or env_class.__name__,
        )

    def _call(self, method: str, request):
        try:
            if method == "Info":
                return self.table.info()
            return getattr(self.table, method.lower())(request, self.timeout_s)
        except RelayError as err:
            raise EnvError(err.code, str(err)) from None

    def disconnect(self) -> None:
        """Close every open session (reason "aborted") and stop the table's threads."""
        self.table.shutdown()

    def __enter__(self) -> LocalEnvironmentClient:
        return self

    def __exit__(self, *exc) -> None:
        self.disconnect()


class AsyncLocalEnvironmentClient:
    """A ``LocalEnvironmentClient`` with ``AsyncEnvironmentClient``'s coroutine API: in-process episodes (tests, the
    tiny chat model's pretraining). Its calls run on the awaiting thread."""

    def __init__(self, local: LocalEnvironmentClient) -> None:
        self.local = local

    async def reset(self, session_id: str, task: dict, seed: int | None = None) -> Reset:
        return self.local.reset(session_id, task, seed)

    async def step(self, session_id: str, action: dict) -> Step:
        return self.local.step(session_id, action)

    async def close(self, session_id: str, reason: str = "") -> float | None:
        return self.local.close(session_id, reason)

    async def info(self) -> dict:
        return self.local.info()

    async def disconnect(self) -> None:
        self.local.disconnect()
