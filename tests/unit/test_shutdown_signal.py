"""A role's wait for its stop signal (``relayrl.cli.wait_for_shutdown``) returns when a second signal comes while
the first one's handler is setting the wake-up event: the launcher's death (PR_SET_PDEATHSIG) and a stop can come
together. Setting the event again from the nested handler deadlocked on the event's lock (a rollout worker of a
crashed `relayrl up` ran on until its orphan watchdog killed it 60 s later)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, signal, threading
    from relayrl import cli

    class SignalInsideSet(threading.Event):
        def set(self):
            with self._cond:  # the lock Event.set holds: a second signal lands here
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # bytecodes, at which Python runs the pending handler
                    pass
                self._flag = True
                self._cond.notify_all()

    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    threading.Event = SignalInsideSet  # the event wait_for_shutdown makes (the timer above made its own)
    print(cli.wait_for_shutdown(), flush=True)
    """
)


def test_a_second_signal_inside_the_first_ones_handler_still_stops_the_wait() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "SIGTERM"
