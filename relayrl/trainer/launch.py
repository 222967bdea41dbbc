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
``relayrl up`` starts its one trainer rank the same way, as the role itself.

N ranks of ``relayrl.cli`` on one host, restarted by nobody (exactly ``--standalone --nproc-per-node=N``, on a host
without GPUs: CUDA does not survive a fork), are forked from the supervisor (``fork_ranks``), which imported torch
and the trainer already (a fork of ``relayrl up``'s fork server), each in its own session with the agent's
environment for its rank: a fresh interpreter per rank spends seconds of a core importing them again. As the agent
does, a rank that fails stops the others (SIGTERM, SIGKILL after ``STOP_GRACE_S``) and its exit code is the
supervisor's. Anything else (nodes, ``--max-restarts``, rendezvous options, a script) runs under torchrun.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from relayrl.runtime.forkserver import ENTRY_MODULE, run_forked_command
from relayrl.runtime.ports import free_port
from relayrl.runtime.procs import child_pids, signal_pids

STOP_GRACE_S = 30.0  # torchrun's agent: the other ranks' SIGTERM before SIGKILL (PContext.close's timeout)
SINGLE_RANK_OPTIONS = ({"--standalone", "--nproc-per-node=1"}, {"--standalone", "--nproc_per_node=1"})


def standalone_ranks(torchrun_args: list[str]) -> int | None:
    """N when ``torchrun_args`` are exactly ``--standalone --nproc-per-node=N`` (either spelling, either order)
    before ``-m``, else None."""
    if "-m" not in torchrun_args:
        return None
    options = torchrun_args[: torchrun_args.index("-m")]
    counts = [o.split("=", 1)[1] for o in options if o.startswith(("--nproc-per-node=", "--nproc_per_node="))]
    if len(options) != 2 or "--standalone" not in options or len(counts) != 1 or not counts[0].isdigit():
        return None
    return int(counts[0])


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
    return rank_env(0, 1, free_port())


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun's agent exports to rank ``rank`` of a standalone job of ``world`` ranks on one host, rank 0
    hosting the store on ``port``."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }  # fmt: skip


def run_supervised(torchrun_args: list[str], *, fork: bool = False) -> int:
    """Run the ranks (forked when ``fork`` and they are ``relayrl.cli`` ranks on one host, under torchrun, or the
    single rank directly); SIGTERM and SIGINT go to the ranks only. Returns their exit code (128 + the signal for
    a rank killed by one)."""
    world = standalone_ranks(torchrun_args)
    module = torchrun_args[torchrun_args.index("-m") + 1] if "-m" in torchrun_args else None
    if fork and world is not None and module == ENTRY_MODULE:
        return fork_ranks(world, torchrun_args[torchrun_args.index("-m") + 2 :])
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


def fork_ranks(world: int, args: list[str]) -> int:
    """Fork ``world`` ranks of ``python -m relayrl.cli ARGS`` (module docstring) and wait for them: 0 when every
    rank exits 0, else the first failure's code (128 + the signal for a rank killed by one)."""
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.setsid()  # its own session, as torchrun's agent starts each rank
            run_forked_command(list(args), {**os.environ, **rank_env(rank, world, port)})
        ranks.append(pid)

    def forward(signum, _frame) -> None:
        signal_pids(ranks, signal.Signals(signum))

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return wait_ranks(ranks)


def wait_ranks(ranks: list[int]) -> int:
    """Reap ``ranks`` (no other child of this process); the first that fails stops the others (SIGTERM, SIGKILL
    after ``STOP_GRACE_S``)."""
    left, failed, deadline = list(ranks), None, None
    while left:
        ended = {pid: status for pid, status in (os.waitpid(pid, os.WNOHANG) for pid in left) if pid}
        left = [pid for pid in left if pid not in ended]
        for status in ended.values():
            code = os.waitstatus_to_exitcode(status)
            if code != 0 and failed is None:
                failed = code if code > 0 else 128 - code
                signal_pids(left, signal.SIGTERM)
                deadline = time.monotonic() + STOP_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            signal_pids(left, signal.SIGKILL)
            deadline = None
        if left and not ended:
            time.sleep(0.05)
    return failed or 0
