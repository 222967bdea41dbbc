"""Each rollout worker of a run draws its own random stream for requests without a seed (``worker_seed``):
one stream per worker id, the same after a restart, never the same for two workers."""

from __future__ import annotations

import subprocess
import sys

from relayrl.config import load_config
from relayrl.rollout.engine import worker_seed
from relayrl.services.rollout_server import serve_rollout
from relayrl.wire.sampling import SamplingParams

PROMPTS = [[3, 4, 5], [6, 7, 8]]


def test_seeds_differ_by_worker_and_hold_across_processes() -> None:
    seeds = {worker_seed(0, f"rollout-{i}") for i in range(64)}
    assert len(seeds) == 64 and all(0 <= s < 2**32 for s in seeds)
    assert worker_seed(0, "rollout-0") != worker_seed(1, "rollout-0")  # run.seed still matters
    code = "from relayrl.rollout.engine import worker_seed; print(worker_seed(0, 'rollout-0'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(other) == worker_seed(0, "rollout-0")  # not Python's per-process salted hash


def test_two_workers_sample_differently_and_a_restarted_worker_repeats_its_stream(make_config) -> None:
    """Through serve_rollout, as ``relayrl up`` starts them (``--worker-id rollout-i``, one run.seed)."""
    cfg = load_config(make_config(rollout={"workers": 2, "n": 8, "max_tokens": 6}))
    params = SamplingParams(n=8, max_tokens=6, temperature=1.0)

    def first_tokens(worker_id: str) -> list[list[int]]:
        server, worker, _ = serve_rollout(
            cfg, controller=None, host="127.0.0.1", port=0, advertise=None, worker_id=worker_id
        )
        try:
            return [c.token_ids for c in worker.engine.generate(PROMPTS, params)]
        finally:
            server.stop(grace_s=0)
            worker.engine.close()

    zero, one, zero_again = first_tokens("rollout-0"), first_tokens("rollout-1"), first_tokens("rollout-0")
    assert zero != one
    assert zero == zero_again
