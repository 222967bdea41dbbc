"""A batch's episode statistics (BatchStats fields 35-42) from the episodes that ended while it was built."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence

from relayrl.episodes.loop import Episode
from relayrl.v1 import controller_pb2


def fill_episode_stats(stats: controller_pb2.BatchStats, episodes: Sequence[Episode]) -> None:
    """Means over ``episodes`` (failed ones included: they cost turns and environment time too); nothing when empty.
    ``env_metrics``: each metric's mean over every turn that reported it."""
    if not episodes:
        return
    count = len(episodes)
    turns = [e.turns for e in episodes]
    stats.episodes = count
    stats.turns_mean = sum(turns) / count
    stats.turns_median = float(statistics.median(turns))
    stats.env_seconds_mean = sum(e.env_seconds for e in episodes) / count
    stats.tool_parse_errors = sum(e.parse_errors for e in episodes)
    stats.observation_tokens_mean = sum(e.observation_tokens for e in episodes) / count
    stats.episode_ends.update(Counter(e.end for e in episodes))
    values: dict[str, list[float]] = {}
    for episode in episodes:
        for name, series in episode.env_metrics.items():
            values.setdefault(name, []).extend(series)
    stats.env_metrics.update({name: sum(v) / len(v) for name, v in values.items() if v})


def step_episode_metrics(stats: controller_pb2.BatchStats) -> dict[str, float]:
    """The metrics.jsonl keys of a batch's episode statistics (empty for a single-turn batch)."""
    if not stats.episodes:
        return {}
    metrics = {
        "episodes": stats.episodes,
        "turns_mean": stats.turns_mean,
        "turns_median": stats.turns_median,
        "env_seconds_mean": stats.env_seconds_mean,
        "tool_parse_errors": stats.tool_parse_errors,
        "observation_tokens_mean": stats.observation_tokens_mean,
    }
    metrics |= {f"episode_end/{end}": count for end, count in sorted(stats.episode_ends.items())}
    metrics |= {f"env/{name}": value for name, value in sorted(stats.env_metrics.items())}
    return metrics
