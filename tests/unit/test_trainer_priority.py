"""yield_cores_to_generation: a streaming trainer beside its rollout workers lowers its session's autogroup to
nice 19 while its step's batch is being generated, so generation gets the shared cores first, and puts it back
the moment the stream's last part is read (relayrl/cores/threads.py); without autogroups its threads run at
nice 19 for the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import RelayConfig
from relayrl.cores.threads import TRAINER_NICE_ENV, autogroups, trainer_env

# A fresh process in a session of its own (so the autogroup it renices is its own, not pytest's); prints the nice
# it would apply, the nice its threads then have, and its autogroup's line ("/autogroup-N nice K") if the kernel
# has one.
PROBE = """
import json, os, threading
from pathlib import Path
from relayrl.cores.threads import yield_cores_to_generation
applied = yield_cores_to_generation().nice
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


# A streamed step (the trainer loop's train_streamed, rank 0 of one) in a fresh session: the nice its session
# (autogroup, or its threads without autogroups) has at start, while each part is read, while the first chunk
# trains after the stream's end was read (the chunk waits for it), and after the step.
STREAM_PROBE = """
import json, os, sys, threading
from pathlib import Path
import torch, torch.distributed as dist
from relayrl.config import ModelConfig
from relayrl.cores.threads import autogroups, yield_cores_to_generation
from relayrl.runtime.ports import free_port
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.loop import local_ranks, train_streamed
from test_stream_step import N, PAD, TARGET, relay_config
from trainer_testing import batch_message, stream_source

def nice():
    if autogroups():
        return int(Path("/proc/self/autogroup").read_text().split()[-1])
    return os.getpriority(os.PRIO_PROCESS, 0)

priority = yield_cores_to_generation()
seen = {"start": nice(), "threads": os.getpriority(os.PRIO_PROCESS, 0), "open": []}
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
cfg = relay_config("token-mean")
backend = FSDPBackend(ModelConfig(path=sys.argv[1]), cfg.trainer, with_reference=False)
batch = batch_message(backend, 6, seed=6, n=N, target=TARGET)
ended = threading.Event()

def parts():
    for kind, payload in stream_source(batch, [2, 4], 0)():
        if kind == "end":
            ended.set()
        else:
            seen["open"].append(nice())
        yield kind, payload

forward = backend.logprobs
def first_chunk_waits(*args, **kwargs):
    if "chunk" not in seen:
        seen["end_read"] = ended.wait(10)
        for _ in range(100):
            if nice() == seen["start"]:
                break
            ended.wait(0.05)
        seen["chunk"] = nice()
    return forward(*args, **kwargs)
backend.logprobs = first_chunk_waits

trained, _ = train_streamed(backend, cfg, 1, parts, frozenset({"w0"}), PAD, local_ranks(priority))
seen["after"] = nice()
seen["samples"] = len(trained.samples)
dist.destroy_process_group()
print(json.dumps(seen))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's per-thread nice and autogroups")
def test_a_streaming_trainer_yields_while_its_batch_generates_and_only_then(tiny_model_dir) -> None:
    env = {**os.environ, TRAINER_NICE_ENV: "19", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", STREAM_PROBE, str(tiny_model_dir)], env=env, capture_output=True, text=True,
        timeout=300, start_new_session=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["samples"] == 6 * 4 and seen["open"] == [19, 19], seen  # every part read at nice 19
    if autogroups():  # the session yields during generation only; its threads keep their priority
        assert seen["start"] == seen["threads"] == 0, seen
        assert seen["end_read"] and seen["chunk"] == 0, seen  # back as the end is read, mid-chunk
        assert seen["after"] == 0, seen
    else:  # no autogroups: the threads' nice, which an unprivileged process cannot raise back
        assert seen["start"] == seen["chunk"] == seen["after"] == 19, seen


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
