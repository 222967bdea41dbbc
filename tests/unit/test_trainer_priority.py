"""yield_cores_to_generation: a streaming trainer beside its rollout workers lowers itself and its session's
autogroup to nice 19, so generation gets the shared cores first (relayrl/cores/threads.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import RelayConfig
from relayrl.cores.threads import TRAINER_NICE_ENV, trainer_env

# A fresh process in a session of its own (so the autogroup it renices is its own, not pytest's); prints what it
# applied, the nice its threads then have, and its autogroup's line ("/autogroup-N nice K") if the kernel has one.
PROBE = """
import json, os, threading
from pathlib import Path
from relayrl.cores.threads import yield_cores_to_generation
applied = yield_cores_to_generation()
seen = []
thread = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))
thread.start(); thread.join()
group = Path("/proc/self/autogroup")
print(json.dumps({"applied": applied, "main": os.getpriority(os.PRIO_PROCESS, 0), "thread": seen[0],
                  "autogroup": group.read_text().strip() if group.exists() else None}))
"""


def probe(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != TRAINER_NICE_ENV}
    if value is not None:
        env[TRAINER_NICE_ENV] = value
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, start_new_session=True
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's per-thread nice and autogroups")
def test_the_trainer_and_the_threads_it_starts_run_at_the_lowest_priority() -> None:
    done = probe("19")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["applied"] == seen["main"] == seen["thread"] == 19
    if seen["autogroup"] is not None and Path("/proc/sys/kernel/sched_autogroup_enabled").exists():
        assert seen["autogroup"].endswith("nice 19"), seen["autogroup"]


def test_unset_or_zero_leaves_the_priority_alone() -> None:
    start = os.getpriority(os.PRIO_PROCESS, 0)
    for value in (None, "0"):
        done = probe(value)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["applied"] == 0 and seen["main"] == start, seen


@pytest.mark.parametrize("value", ["high", "-5", "20"])
def test_a_bad_value_names_the_variable(value) -> None:
    done = probe(value)
    assert done.returncode != 0
    assert f"{TRAINER_NICE_ENV}: {value!r} is not a nice value from 0 to 19" in done.stderr


@pytest.mark.parametrize(("stream", "staleness", "preset", "nice"), [
    ("auto", 0, None, "19"), ("off", 0, None, None), ("auto", 1, None, None), ("auto", 0, "0", None),
])  # fmt: skip
def test_only_a_streaming_trainer_yields_unless_told_otherwise(monkeypatch, stream, staleness, preset, nice) -> None:
    """Streaming (K = 0, trainer.stream auto/on) is where the trainer's chunks meet the last decode steps; a whole
    batch alternates with generation, and K = 1 does not stream. A value the user exported is inherited as it is."""
    if preset is None:
        monkeypatch.delenv(TRAINER_NICE_ENV, raising=False)
    else:
        monkeypatch.setenv(TRAINER_NICE_ENV, preset)
    cfg = RelayConfig.model_validate(
        {
            "model": {"path": "m"},
            "data": {"path": "d"},
            "trainer": {"stream": stream},
            "controller": {"max_staleness": staleness, "dynamic_sampling": False},
        }
    )
    assert trainer_env(cfg).get(TRAINER_NICE_ENV) == nice
