"""Where the environment pool sends a new episode: the server whose next call is expected soonest (mean call seconds
x (1 + sessions / max_sessions)), so a slow environment server holds no episode while faster ones have room."""

from __future__ import annotations

import asyncio

from relayrl.env.types import Reset
from relayrl.episodes.envpool import EnvironmentPool


class Answers:
    """An environment client whose calls answer at once; the pool's timings are set by the test."""

    async def reset(self, session_id, task, seed=None):
        return Reset([{"role": "user", "content": "hi"}])

    async def disconnect(self):
        pass


def picks(pool: EnvironmentPool, count: int) -> list[str]:
    """The servers the next ``count`` sessions go to, each session kept open."""
    chosen = []
    for _ in range(count):
        server = pool._pick()
        server.sessions += 1
        chosen.append(next(a for a, s in pool.servers.items() if s is server))
    return chosen


def pool_of(*addresses: str, max_sessions: int = 64) -> EnvironmentPool:
    return EnvironmentPool(list(addresses), max_sessions=max_sessions, timeout_s=1, client_factory=lambda _: Answers())


def test_servers_not_heard_yet_or_equally_fast_share_the_episodes_evenly() -> None:
    pool = pool_of("a", "b", "c")
    assert sorted(picks(pool, 6)) == ["a", "a", "b", "b", "c", "c"]
    for server in pool.servers.values():
        server.observe(0.02)
    assert sorted(picks(pool, 3)) == ["a", "b", "c"]


def test_a_twenty_times_slower_server_gets_episodes_only_once_the_fast_ones_are_full() -> None:
    pool = pool_of("fast-1", "fast-2", "slow", max_sessions=20)
    for address, seconds in (("fast-1", 0.01), ("fast-2", 0.01), ("slow", 0.2)):
        pool.servers[address].observe(seconds)
    chosen = picks(pool, 43)
    assert chosen[:40].count("slow") == 0 and chosen[40:] == ["slow"] * 3  # the overflow of 2 x 20 fast slots
    assert chosen[:40].count("fast-1") == chosen[:40].count("fast-2") == 20  # equal servers share evenly
    near = pool_of("a", "b", max_sessions=10)  # a server 1.45x slower takes episodes once the faster holds 5
    near.servers["a"].observe(0.10), near.servers["b"].observe(0.145)
    assert picks(near, 7) == ["a"] * 5 + ["b", "a"]  # a at 5: 0.10 x 1.5 > 0.145; b at 1: 0.145 x 1.1 > 0.15


def test_a_server_learns_its_mean_call_time_from_its_answers_and_one_not_heard_counts_the_median() -> None:
    async def main() -> None:
        pool = pool_of("a", "b", "c")
        async with pool.open("s0", {}, None) as (_client, _reset):
            assert pool.servers["a"].seconds is not None and pool.servers["b"].seconds is None
        pool.servers["a"].observe(0.5)  # moving average: 0.8 x the first answer + 0.2 x 0.5
        assert 0.1 <= pool.servers["a"].seconds <= 0.5
        pool.servers["b"].observe(1.0)
        pool.servers["a"].sessions = 64  # full
        # c, not heard yet, counts the median of a and b (~0.55): it goes first, and again (0.55 x 65/64) before b
        assert picks(pool, 2) == ["c", "c"]

    asyncio.run(main())
