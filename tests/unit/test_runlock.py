"""runtime.runlock: one holder per run directory, a refusal naming it, a dead launcher told from a live one, no lock
file left once the run is released."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.runtime import runlock
from relayrl.runtime.runlock import (
    Owner,
    RunHeld,
    RunLock,
    RunLockUnsupported,
    filesystem_of,
    process_start_ticks,
    refuse_if_held,
    same_file,
)


def test_a_second_claim_is_refused_naming_the_holder_until_its_descriptor_closes(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    lock = RunLock.take(run_dir)
    with pytest.raises(RunHeld) as refused:
        RunLock.take(run_dir)  # another open file description: flock refuses it as it would another process
    assert f"is held by pid {os.getpid()} on {socket.gethostname()} since " in str(refused.value)
    assert "\n" not in str(refused.value)
    os.close(lock.fd)  # the holder gone: the next claim takes it
    RunLock.take(run_dir)


def test_a_lock_held_by_a_live_child_is_refused_and_taken_once_the_child_exits(tmp_path: Path) -> None:
    """A run's processes hold the lock with the launcher (the descriptor passed on): it goes with the last."""
    run_dir = tmp_path / "runs" / "r"
    lock = RunLock.take(run_dir)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             pass_fds=(lock.fd,))  # fmt: skip
    os.close(lock.fd)
    with pytest.raises(RunHeld):
        RunLock.take(run_dir)
    child.communicate(b"")
    assert RunLock.take(run_dir).fd >= 0


def test_an_owner_is_gone_when_no_process_has_its_pid_and_start_time() -> None:
    me = Owner.me()
    assert me.start_ticks == process_start_ticks(os.getpid()) and not me.gone()
    assert Owner(me.pid, me.host, me.start_ticks + 1, me.since).gone()  # the pid reused by a later process
    assert not Owner(me.pid, "another-host", None, me.since).gone()  # another host's: cannot be known dead


def test_a_dead_launchers_record_is_waited_for_and_then_taken(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    lock = RunLock.take(run_dir)
    dead = Owner(os.getpid(), socket.gethostname(), -1, 0.0)  # what a crashed launcher left behind
    RunLock.path_for(run_dir).write_text(json.dumps(dead.__dict__))
    said: list[str] = []
    with pytest.raises(RunHeld, match="its launcher died; its processes are still stopping"):
        RunLock.take(run_dir, wait_dead_s=0.6, on_wait=said.append)
    assert len(said) == 1 and "died; waiting" in said[0]
    os.close(lock.fd)  # its processes gone: the next claim takes it and writes its own record
    RunLock.take(run_dir, wait_dead_s=0.6)
    assert json.loads(RunLock.path_for(run_dir).read_text())["start_ticks"] == process_start_ticks(os.getpid())


def test_a_dead_launchers_refusal_names_the_processes_still_holding_its_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    lock = RunLock.take(run_dir)
    dead = Owner(os.getpid(), socket.gethostname(), -1, 0.0)
    RunLock.path_for(run_dir).write_text(json.dumps(dead.__dict__))
    role = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(lock.fd,))
    try:
        os.close(lock.fd)  # the launcher is gone; only its child holds the lock now
        with pytest.raises(RunHeld) as refused:
            RunLock.take(run_dir, wait_dead_s=0.0)
        assert f"still stopping: pid {role.pid} ({sys.executable} -c import time; time.sleep(60))" in str(refused.value)
    finally:
        role.kill()
        role.wait()
    RunLock.take(run_dir)  # the last holder gone: taken


def test_abandon_removes_the_lock_and_the_runs_directory_it_made(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    RunLock.take(run_dir).abandon()
    assert not (tmp_path / "runs").exists()


def test_release_leaves_no_lock_file_and_a_claimant_that_opened_it_before_takes_a_fresh_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    lock = RunLock.take(run_dir)
    early = os.open(RunLock.path_for(run_dir), os.O_RDWR)  # a claimant that opened the file, not yet locked
    lock.release()
    assert not RunLock.path_for(run_dir).exists() and (tmp_path / "runs").is_dir()
    fcntl.flock(early, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it locks the removed file: the name no longer leads there
    assert not same_file(early, RunLock.path_for(run_dir))
    os.close(early)
    again = RunLock.take(run_dir)
    assert json.loads(RunLock.path_for(run_dir).read_text())["pid"] == os.getpid()
    again.release()


def test_the_probe_names_a_live_holder_and_creates_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    refuse_if_held(run_dir)  # no lock file: no live run
    assert not (tmp_path / "runs").exists()
    lock = RunLock.take(run_dir)
    with pytest.raises(RunHeld, match=f"is held by pid {os.getpid()} "):
        refuse_if_held(run_dir)
    os.close(lock.fd)
    refuse_if_held(run_dir)


def test_the_filesystem_is_read_from_mountinfo(tmp_path: Path) -> None:
    assert filesystem_of(Path("/proc/self"))[0] == "proc"
    assert filesystem_of(tmp_path)[0] and RunLock.take(tmp_path / "runs" / "r").caveat is None  # a local disk


@pytest.mark.parametrize(
    ("fstype", "options", "caveat"),
    [
        ("nfs4", "rw,vers=4.2", "is on nfs4: NFS emulates flock with a POSIX lock that the run's processes do not"),
        ("lustre", "rw,localflock", "is on lustre mounted localflock: it refuses a second run on this node only"),
        ("lustre", "rw,flock", None),
    ],
)
def test_a_lock_that_holds_less_there_says_so_in_one_line(tmp_path: Path, monkeypatch, fstype, options, caveat):
    monkeypatch.setattr(runlock, "filesystem_of", lambda path: (fstype, frozenset(options.split(","))))
    lock = RunLock.take(tmp_path / "runs" / "r")
    assert lock.caveat is None if caveat is None else (caveat in lock.caveat and "\n" not in lock.caveat)


def test_a_filesystem_without_flock_is_named_in_one_line_and_relayrl_up_exits_2(tmp_path: Path, monkeypatch, capsys):
    """Lustre mounted without -o flock answers flock with ENOSYS: a plain OSError and a traceback before."""
    import errno
    import fcntl

    from relayrl.cli import main

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(runlock, "filesystem_of", lambda path: ("lustre", frozenset({"rw"})))
    monkeypatch.setattr(fcntl, "flock", no_flock)
    run_dir = tmp_path / "runs" / "r"
    message = "run lock .*\\.r\\.lock: lustre refuses flock \\(Function not implemented\\); mount it with -o flock"
    with pytest.raises(RunLockUnsupported, match=message):
        RunLock.take(run_dir)
    assert not (tmp_path / "runs").exists()  # nothing left behind
    run_dir.parent.mkdir()
    RunLock.path_for(run_dir).touch()  # a lock file from a start elsewhere
    with pytest.raises(RunLockUnsupported, match=message):
        refuse_if_held(run_dir)
    demo = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"
    assert main(["up", str(demo), "--set", f"run.dir={tmp_path / 'runs'}", "--set", "run.name=r"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("relayrl: run lock ") and "lustre refuses flock" in err and "\n" not in err


def test_the_probe_waits_out_a_dead_launchers_processes_and_says_so(tmp_path: Path) -> None:
    """``relayrl up`` probes when its checks fail (a port in use): a dead launcher's role still stopping holds the
    port and the lock, so the probe waits until it exits (True: check again), as ``take`` would."""
    run_dir = tmp_path / "runs" / "r"
    lock = RunLock.take(run_dir)
    dead = Owner(os.getpid(), socket.gethostname(), -1, 0.0)
    RunLock.path_for(run_dir).write_text(json.dumps(dead.__dict__))
    role = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"], pass_fds=(lock.fd,))
    os.close(lock.fd)  # the launcher is gone; its role stops a little later
    said: list[str] = []
    try:
        assert refuse_if_held(run_dir, wait_dead_s=60, on_wait=said.append) is True
        assert role.wait(timeout=10) == 0 and len(said) == 1 and "died; waiting for its processes" in said[0]
    finally:
        role.kill()
        role.wait()
    assert refuse_if_held(run_dir, wait_dead_s=60) is False  # nothing held: nothing waited for
