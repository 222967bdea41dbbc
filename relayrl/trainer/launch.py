"""``relayrl trainer launch``: torchrun under a supervisor that turns SIGTERM into a clean stop.

torchrun answers SIGTERM by killing its ranks and exiting non-zero. Preemption (Kubernetes, Slurm)
deserves better: the supervisor forwards SIGTERM to the *ranks* only, they finish the step in
progress, checkpoint and exit 0, and torchrun then exits 0 with them.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from relayrl.procs import child_pids, signal_pids


def run_supervised(torchrun_args: list[str]) -> int:
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun_args], start_new_session=True)

    def forward(signum, _frame) -> None:
        signal_pids(child_pids(proc.pid), signal.Signals(signum))

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return proc.wait()
