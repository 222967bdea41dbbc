"""The sessions of one environment server: one ``Environment`` instance per episode, keyed by session id.

Works on environment.proto messages, so the gRPC servicer (relayrl/env/server.py) and the in-process client
(``LocalEnvironmentClient``) share every check and answer the same statuses:
- Reset: ALREADY_EXISTS for an id in use; RESOURCE_EXHAUSTED at ``max_sessions`` (0: no limit);
  INVALID_ARGUMENT naming a bad field (session_id, task).
- Step: NOT_FOUND for an unknown or expired session; FAILED_PRECONDITION while another call of the same session
  is still running (one call at a time per episode, also after a call ran past its deadline).
- Close: idempotent (an unknown session answers no reward).
A session idle longer than ``idle_timeout_s`` is reclaimed by ``reap`` (its environment closed with reason
"expired"), so a caller that died never holds a slot for good.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from relayrl.env.base import Environment
from relayrl.env.messages import message_from_proto, messages_to_proto, tools_to_proto
from relayrl.env.runner import EnvironmentFailed, Runner
from relayrl.env.types import Reset, Step
from relayrl.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, RelayError, ResourceExhausted
from relayrl.rpc.validate import check_length
from relayrl.v1 import environment_pb2 as pb

log = logging.getLogger(__name__)

MAX_ID_CHARS = 256
CLOSE_TIMEOUT_S = 30.0  # the deadline of close() for sessions relayrl ends itself (expired, shutdown)
OnCancel = Callable[[Callable[[], object]], object]  # registers what cancels a call (gRPC: context.add_callback)


@dataclass
class _Session:
    env: Environment | None
    last_used: float
    busy: threading.Lock = field(default_factory=threading.Lock)  # held while a call of the session runs


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class SessionTable:
    """Sessions of ``factory()`` environments. ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(
        self,
        factory: Callable[[], Environment],
        *,
        max_sessions: int = 0,
        idle_timeout_s: float = 600.0,
        workers: int = 32,
        name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions < 0:
            raise ValueError(f"max_sessions: must be >= 0 (0: no limit), got {max_sessions}")
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s: must be > 0, got {idle_timeout_s}")
        self.factory, self.max_sessions, self.idle_timeout_s = factory, max_sessions, idle_timeout_s
        self.name = name or getattr(factory, "name", "") or getattr(factory, "__name__", "environment")
        self.clock = clock
        self.runner = Runner(workers)
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # -- the four calls ------------------------------------------------------------------------------
    def reset(
        self, request: pb.ResetRequest, timeout_s: float | None = None, on_cancel: OnCancel | None = None
    ) -> pb.ResetResponse:
        session_id = request.session_id
        check_length("session_id", session_id, MAX_ID_CHARS, required=True)
        task = _task(request.task)
        seed = request.seed if request.HasField("seed") else None
        session = _Session(env=None, last_used=self.clock())
        session.busy.acquire()
        with self._lock:
            if session_id in self._sessions:
                raise AlreadyExists(f"session_id: {session_id!r} is in use (Close it first)")
            if self.max_sessions and len(self._sessions) >= self.max_sessions:
                raise ResourceExhausted("sessions", self.max_sessions, len(self._sessions) + 1)
            self._sessions[session_id] = session
        try:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            session.env = self.runner.call(self.factory, timeout_s=timeout_s, what=f"{self.name}()")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            future = self.runner.submit(session.env.reset, task, seed)
            if on_cancel is not None:
                on_cancel(future.cancel)
            result = self.runner.result(future, left, f"{self.name}.reset")
            response = _reset_response(result, self.name)
        except BaseException:
            with self._lock:
                if self._sessions.get(session_id) is session:
                    del self._sessions[session_id]
            session.busy.release()
            raise
        session.last_used = self.clock()
        session.busy.release()
        return response

    def step(
        self, request: pb.StepRequest, timeout_s: float | None = None, on_cancel: OnCancel | None = None
    ) -> pb.StepResponse:
        """``on_cancel(cancel)``: how the caller's cancellation reaches the call (an async environment method is
        cancelled; a sync one cannot be interrupted). The gRPC servicer passes ``context.add_callback``."""
        check_length("session_id", request.session_id, MAX_ID_CHARS, required=True)
        if not request.HasField("action"):
            raise InvalidArgument("action", "required (the assistant's message)")
        if request.action.role != "assistant":
            raise InvalidArgument("action.role", f"must be 'assistant', got {request.action.role[:64]!r}")
        action = message_from_proto(request.action, "action")
        for i, call in enumerate(request.action.tool_calls):
            if not call.name:
                raise InvalidArgument(f"action.tool_calls[{i}].name", "must not be empty")
        session = self._get(request.session_id)
        future = self.runner.submit(session.env.step, action)
        future.add_done_callback(lambda _: self._done(session))
        if on_cancel is not None:
            on_cancel(future.cancel)
        return _step_response(self.runner.result(future, timeout_s, f"{self.name}.step"), self.name)

    def close(self, request: pb.CloseRequest, timeout_s: float | None = None) -> pb.CloseResponse:
        check_length("session_id", request.session_id, MAX_ID_CHARS, required=True)
        check_length("reason", request.reason, MAX_ID_CHARS)
        with self._lock:
            session = self._sessions.pop(request.session_id, None)
        if session is None:
            return pb.CloseResponse()
        if not session.busy.acquire(timeout=-1 if timeout_s is None else timeout_s):
            log.warning("session %s closed while a call is still running: its close() is skipped", request.session_id)
            return pb.CloseResponse()
        try:
            reward = self.runner.call(session.env.close, request.reason, timeout_s=timeout_s, what=f"{self.name}.close")
        finally:
            session.busy.release()
        if reward is None:
            return pb.CloseResponse()
        if not _finite(reward):
            raise EnvironmentFailed(f"{self.name}.close returned {reward!r}: not a finite number or None")
        return pb.CloseResponse(reward=float(reward))

    def info(self) -> pb.InfoResponse:
        with self._lock:
            held = len(self._sessions)
        return pb.InfoResponse(name=self.name, max_sessions=self.max_sessions, sessions=held)

    # -- idle sessions -------------------------------------------------------------------------------
    def reap(self) -> list[str]:
        """Close the sessions idle longer than ``idle_timeout_s`` (not those in a call); returns their ids."""
        now = self.clock()
        with self._lock:
            expired = [
                (sid, s)
                for sid, s in self._sessions.items()
                if now - s.last_used > self.idle_timeout_s and not s.busy.locked()
            ]
            for sid, _ in expired:
                del self._sessions[sid]
        for sid, session in expired:
            try:
                self.runner.call(session.env.close, "expired", timeout_s=CLOSE_TIMEOUT_S, what=f"{self.name}.close")
            except RelayError as err:
                log.warning("session %s expired: %s", sid, err)
        if expired:
            log.info("reclaimed %d session(s) idle for more than %.0f s", len(expired), self.idle_timeout_s)
        return [sid for sid, _ in expired]

    def start_reaper(self, interval_s: float | None = None) -> None:
        """Reap on a daemon thread every ``interval_s`` (default: a quarter of the idle timeout, at most 30 s)."""
        interval_s = interval_s or min(self.idle_timeout_s / 4, 30.0)

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.reap()

        threading.Thread(target=loop, name="env-reaper", daemon=True).start()

    def shutdown(self) -> None:
        """Stop reaping, close every session (reason "aborted"), stop the runner."""
        self._stop.set()
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            if session.env is not None and session.busy.acquire(timeout=1.0):
                try:
                    self.runner.call(session.env.close, "aborted", timeout_s=CLOSE_TIMEOUT_S, what=f"{self.name}.close")
                except RelayError as err:
                    log.warning("%s", err)
        self.runner.shutdown()

    # -- helpers -------------------------------------------------------------------------------------
    def _get(self, session_id: str) -> _Session:
        """The session, marked busy (released by ``_done``)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise NotFound(f"session_id: no session {session_id!r} (never reset, closed or expired)")
            if not session.busy.acquire(blocking=False):
                raise FailedPrecondition(f"session_id: a call of session {session_id!r} is still running")
        return session

    def _done(self, session: _Session) -> None:
        session.last_used = self.clock()
        session.busy.release()


def _task(text: str) -> dict:
    if not text:
        return {}
    try:
        task = json.loads(text)
    except ValueError as err:
        raise InvalidArgument("task", f"not valid JSON ({err})") from None
    if not isinstance(task, dict):
        raise InvalidArgument("task", f"must be a JSON object, got {type(task).__name__}")
    return task


def _reset_response(result, name: str) -> pb.ResetResponse:
    if not isinstance(result, Reset):
        raise EnvironmentFailed(f"{name}.reset returned {type(result).__name__}, not relayrl.env.Reset")
    try:
        messages = messages_to_proto(result.messages, f"{name}.reset().messages")
        tools = tools_to_proto(result.tools, f"{name}.reset().tools")
    except InvalidArgument as err:
        raise EnvironmentFailed(str(err)) from None
    if not messages:
        raise EnvironmentFailed(f"{name}.reset().messages: must hold at least one message")
    return pb.ResetResponse(messages=messages, tools=tools)


def _step_response(result, name: str) -> pb.StepResponse:
    if not isinstance(result, Step):
        raise EnvironmentFailed(f"{name}.step returned {type(result).__name__}, not relayrl.env.Step")
    where = f"{name}.step()"
    try:
        observations = messages_to_proto(result.observations, f"{where}.observations")
    except InvalidArgument as err:
        raise EnvironmentFailed(str(err)) from None
    if result.reward is not None and not _finite(result.reward):
        raise EnvironmentFailed(f"{where}.reward: {result.reward!r} is not a finite number or None")
    if not isinstance(result.metrics, dict):
        raise EnvironmentFailed(f"{where}.metrics: must be a dict, got {type(result.metrics).__name__}")
    for key, value in result.metrics.items():
        if not isinstance(key, str) or not _finite(value):
            raise EnvironmentFailed(f"{where}.metrics[{key!r}]: needs a str key and a finite number, got {value!r}")
    response = pb.StepResponse(
        observations=observations,
        done=bool(result.done),
        truncated=bool(result.truncated),
        metrics={k: float(v) for k, v in result.metrics.items()},
    )
    if result.reward is not None:
        response.reward = float(result.reward)
    return response
