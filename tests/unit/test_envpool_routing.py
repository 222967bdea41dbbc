"""Where the environment pool sends a new episode: the server where one call of each of its episodes, and one more,
is answered soonest ((sessions + 1) x its mean call seconds), so a slow environment server holds few episodes."""

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


def test_a_twenty_times_slower_server_gets_an_episode_once_the_others_hold_twenty_times_as_many() -> None:
    pool = pool_of("fast-1", "fast-2", "slow")
    for address, seconds in (("fast-1", 0.01), ("fast-2", 0.01), ("slow", 0.205)):
        pool.servers[address].observe(seconds)
    chosen = picks(pool, 42)
    assert chosen.count("slow") == 1 and chosen.index("slow") == 40  # once each fast one holds 20: 21 x 0.01 > 0.205
    full = pool_of("fast", "slow", max_sessions=4)  # the bound per server still holds: a full server is skipped
    full.servers["fast"].observe(0.01), full.servers["slow"].observe(0.2)
    assert picks(full, 6) == ["fast"] * 4 + ["slow"] * 2


def test_a_server_learns_its_mean_call_time_from_its_answers_and_one_not_heard_counts_the_median() -> None:
    async def main() -> None:
        pool = pool_of("a", "b", "c")
        async with pool.open("s0", {}, None) as (_client, _reset):
            assert pool.servers["a"].seconds is not None and pool.servers["b"].seconds is None
        pool.servers["a"].observe(0.5)  # moving average: 0.8 x the first answer + 0.2 x 0.5
        assert 0.1 <= pool.servers["a"].seconds <= 0.5
        pool.servers["b"].observe(1.0)
        pool.servers["a"].sessions = 10  # load 11 x ~0.1
        # c, not heard yet, counts the median of a and b (~0.55): it goes first, then b (1.0) before c's second
        assert picks(pool, 2) == ["c", "b"]

    asyncio.run(main())
