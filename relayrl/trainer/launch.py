"""``relayrl trainer launch``: torchrun under a supervisor that turns SIGTERM into a clean stop.

torchrun answers SIGTERM by killing its ranks and exiting non-zero. Preemption (Kubernetes, Slurm)
deserves better: the supervisor forwards SIGTERM to the *ranks* only, they finish the step in
progress, checkpoint and exit 0, and torchrun then exits 0 with them.

One rank on one host, restarted by nobody (exactly ``--standalone --nproc-per-node=1``), skips torchrun's
elastic agent: the supervisor starts the rank itself with the environment the agent would give it
(``single_rank_env``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a store the rank hosts;
``_start_workers`` in torch/distributed/elastic/agent/server/local_elastic_agent.py). The agent is a process
that imports torch only to start that one rank and wait for it: a core's worth of work on the way to the first
step, for nothing.
``relayrl up`` starts its one trainer rank the same way, as the role itself. Anything else (more ranks, nodes,
``--max-restarts``, rendezvous options) runs under torchrun.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from relayrl.runtime.ports import free_port
from relayrl.runtime.procs import child_pids, signal_pids

SINGLE_RANK_OPTIONS = ({"--standalone", "--nproc-per-node=1"}, {"--standalone", "--nproc_per_node=1"})


def single_rank_command(torchrun_args: list[str]) -> list[str] | None:
    """The rank's command line when ``torchrun_args`` start one rank and nothing more (module docstring), else
    None. torchrun runs a module as ``python -u -m module args``."""
    if "-m" not in torchrun_args:
        return None
    split = torchrun_args.index("-m")
    if set(torchrun_args[:split]) not in SINGLE_RANK_OPTIONS or len(torchrun_args[:split]) != 2:
        return None
    return [sys.executable, "-u", *torchrun_args[split:]]


def single_rank_env() -> dict[str, str]:
    """What torchrun's agent exports to the only rank of a standalone job (its store: the rank's own)."""
    return {
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_USE_AGENT_STORE": "False",
    }  # fmt: skip


def run_supervised(torchrun_args: list[str]) -> int:
    """Run the ranks (under torchrun, or the single rank directly); SIGTERM and SIGINT go to the ranks only.
    Returns their exit code (128 + the signal for a rank killed by one)."""
    rank = single_rank_command(torchrun_args)
    if rank is None:
        argv, env = [sys.executable, "-m", "torch.distributed.run", *torchrun_args], None
    else:
        argv, env = rank, {**os.environ, **single_rank_env()}
    proc = subprocess.Popen(argv, start_new_session=True, env=env)

    def forward(signum, _frame) -> None:
        signal_pids(child_pids(proc.pid) if rank is None else [proc.pid], signal.Signals(signum))

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = proc.wait()
    return code if code >= 0 else 128 - code
