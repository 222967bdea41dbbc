"""The environment servers of a run, and at most ``max_sessions`` episodes in flight on each (asyncio).

``EnvironmentPool.session()`` waits for a free slot and yields the client of the server whose next call is expected
to be answered soonest: the least mean call seconds x (1 + sessions / max_sessions). The mean is a moving average
of its Reset/Step/Close answers, so it already holds the queueing of a server that answers its sessions one at a
time (a server not heard yet counts the median of the others); the factor, 1 when idle and 2 when full, spreads
the episodes evenly over equal servers. A server more than twice as slow as another with a free slot gets no new
episode until that one is full: a slow environment holds no episodes (none of the rows the engine could be
decoding) while faster ones have room, and takes the overflow. Servers marked down are skipped while they are
down; the slot is freed when the episode is over. A
server that refuses a Reset as UNAVAILABLE (down, restarting) or RESOURCE_EXHAUSTED (full: it serves other
callers too) is marked down for ``down_s`` and the Reset is tried on another server, up to ``reset_attempts``
times: a Reset starts nothing, so it is safe to repeat. Every later call of an episode stays on its server (the
session lives there): an error there fails the episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Callable

import grpc

from relayrl.env.client import AsyncEnvironmentClient
from relayrl.env.types import EnvError, Reset

RETRY_RESET = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
TIMED = frozenset({"reset", "step", "close"})
EWMA = 0.2  # weight of a call's duration in its server's moving average


class _Server:
    """A server's client, its sessions and ``seconds``: the moving average of its successful calls' durations
    (None until one answered)."""

    def __init__(self, client) -> None:
        self.client = _TimedClient(client, self)
        self.sessions = 0
        self.down_until = 0.0
        self.seconds: float | None = None

    def observe(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else (1 - EWMA) * self.seconds + EWMA * seconds

    def expected_seconds(self, default_seconds: float, max_sessions: int) -> float:
        """Mean call seconds x (1 + sessions / max_sessions) (module docstring)."""
        seconds = self.seconds if self.seconds is not None else default_seconds
        return seconds * (1 + self.sessions / max_sessions)


class _TimedClient:
    """A server's client whose Reset, Step and Close calls, when they succeed, update the server's mean call time."""

    def __init__(self, client, server: _Server) -> None:
        self._client, self._server = client, server

    def __getattr__(self, name: str):
        method = getattr(self._client, name)
        if name not in TIMED:
            return method

        async def timed(*args, **kwargs):
            start = time.monotonic()
            answer = await method(*args, **kwargs)
            self._server.observe(time.monotonic() - start)
            return answer

        return timed


class EnvironmentPool:
    """``servers``: addresses; ``client_factory(address)``: its client (default ``AsyncEnvironmentClient`` with the
    deadline ``timeout_s``). Create it on the event loop that uses it."""

    def __init__(
        self,
        servers: list[str],
        *,
        max_sessions: int,
        timeout_s: float,
        client_factory: Callable[[str], object] | None = None,
        reset_attempts: int = 5,
        down_s: float = 1.0,
    ) -> None:
        if not servers:
            raise ValueError("environment.servers: no environment server (set servers, or serve to start some)")
        factory = client_factory or (lambda address: AsyncEnvironmentClient(address, timeout_s=timeout_s))
        self.servers = {address: _Server(factory(address)) for address in servers}
        self.max_sessions = max_sessions
        self.reset_attempts = reset_attempts
        self.down_s = down_s
        self._freed = asyncio.Condition()

    def _pick(self) -> _Server | None:
        now = time.monotonic()
        free = [s for s in self.servers.values() if s.sessions < self.max_sessions and s.down_until <= now]
        if not free:
            return None
        known = [s.seconds for s in self.servers.values() if s.seconds is not None]
        default = statistics.median(known) if known else 1.0
        return min(free, key=lambda s: s.expected_seconds(default, self.max_sessions))

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[object]:
        """A client with one of its server's session slots taken for the body's duration."""
        async with self._freed:
            while (server := self._pick()) is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), timeout=self.down_s)
            server.sessions += 1
        try:
            yield server.client
        finally:
            async with self._freed:
                server.sessions -= 1
                self._freed.notify_all()

    def _mark_down(self, client) -> None:
        for server in self.servers.values():
            if server.client is client:
                server.down_until = time.monotonic() + self.down_s

    @contextlib.asynccontextmanager
    async def open(self, session_id: str, task: dict, seed: int | None) -> AsyncIterator[tuple[object, Reset]]:
        """(client, Reset) of a new session, its slot held for the body's duration; a refused Reset is tried again
        on another server (module docstring), any other failure raises ``EnvError``."""
        last: EnvError | None = None
        for _ in range(self.reset_attempts):
            async with self.session() as client:
                try:
                    reset = await client.reset(session_id, task, seed)
                except EnvError as err:
                    if err.code not in RETRY_RESET:
                        with contextlib.suppress(EnvError):  # a deadline may have left the session open
                            await client.close(session_id, "aborted")
                        raise
                    last = err
                    self._mark_down(client)
                    continue
                yield client, reset
                return
        assert last is not None
        raise last

    async def close(self) -> None:
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                await server.client.disconnect()
