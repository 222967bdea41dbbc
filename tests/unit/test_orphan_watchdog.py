"""A child of ``relayrl up`` whose launcher died and that does not stop on the SIGTERM it gets is killed, with its
children, once the watchdog's grace has passed; every thread's stack is in its log first."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from relayrl.runtime.procs import PARENT_ENV

STUBBORN_ROLE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from relayrl.runtime.procs import stop_with_parent

    signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM ignored", flush=True))
    stop_with_parent(watchdog_s=float(sys.argv[1]))
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(grandchild.pid, flush=True)
    while True:
        time.sleep(0.1)  # a role stuck in a wait that never ends
    """
)

LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys
    env = {**os.environ, sys.argv[3]: str(os.getpid())}
    log = open(sys.argv[4], "w")
    role = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env, stdout=sys.stdout, stderr=log)
    print(role.pid, flush=True)
    sys.stdin.read()  # until the test kills us
    """
)


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def test_an_orphaned_role_that_ignores_sigterm_is_killed_with_its_children_after_the_grace(tmp_path):
    log = tmp_path / "role.log"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, STUBBORN_ROLE, "1", PARENT_ENV, str(log)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    role, grandchild = int(launcher.stdout.readline()), int(launcher.stdout.readline())
    try:
        time.sleep(1.5)  # longer than the grace: nothing happens while the launcher lives
        assert _alive(role) and _alive(grandchild)
        launcher.kill()
        launcher.wait()
        orphaned = time.monotonic()
        while _alive(role) or _alive(grandchild):
            assert time.monotonic() - orphaned < 30, log.read_text()
            time.sleep(0.1)
        assert time.monotonic() - orphaned >= 1  # the grace was given first
        text = log.read_text()
        assert "has not stopped: killing it and its children" in text
        assert "most recent call first" in text and 'File "<string>"' in text  # faulthandler: the stuck frame
    finally:
        for pid in (role, grandchild):
            subprocess.run(["kill", "-9", str(pid)], stderr=subprocess.DEVNULL)
