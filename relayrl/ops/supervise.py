"""Restarting the roles of a local job that die, the way a kubelet restarts a pod's containers.

``Supervisor.tick()`` runs in the launcher's watch loop. A role whose process exited unasked (any
rollout worker or the controller; the trainer only with a non-zero code) is restarted with the argv and
environment it was first started with, after ``backoff_s * 2**k`` seconds (k = its restarts so far, at most
``backoff_max_s``); the trainer comes back with ``--resume``. The death after ``max_restarts`` restarts raises
``RestartBudgetExhausted`` naming the role and its log. A deterministic failure is not retried: a role that exits
with ``NO_RESTART_CODE``, or a trainer whose run the controller stopped, raises ``RunStopped``. Every restart is
logged and counted in ``<run dir>/supervisor.json`` (role -> pid, restarts, last exit codes), which ``relayrl status``
shows.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.config import SupervisorConfig
from relayrl.runtime.files import atomic_write

log = logging.getLogger(__name__)
STATE_FILE = "supervisor.json"


class RestartBudgetExhausted(RuntimeError):
    pass


class RunStopped(RuntimeError):
    """The run cannot go on and a restart would fail the same way: a role refused its start (exit code
    ``NO_RESTART_CODE``), or the trainer died of a run its controller stopped (``Supervisor``'s ``run_stopped``)."""


NO_RESTART_CODE = 2  # relayrl.cli's exit code for a config error or a corrupt ledger: a person must look


@dataclass
class RestartBudget:
    """Per-role restart counts and the backoff before the next one."""

    cfg: SupervisorConfig
    counts: dict[str, int] = field(default_factory=dict)

    def exhausted(self, role: str) -> bool:
        return self.counts.get(role, 0) >= self.cfg.max_restarts

    def delay_s(self, role: str) -> float:
        """backoff_s * 2**restarts, capped at backoff_max_s."""
        return min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** self.counts.get(role, 0))

    def record(self, role: str) -> None:
        self.counts[role] = self.counts.get(role, 0) + 1


# The last line of a Python traceback: "ValueError: ...", "OSError: ...", "transformers.x.SomeError: ...".
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")


def last_error(log: Path, tail_bytes: int = 65536) -> str:
    """What a role died of, for the console: the last traceback's last line in its log, else the log's last line."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, log.stat().st_size - tail_bytes))
            lines = [line.strip() for line in file.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return next((line for line in reversed(lines) if _ERROR_LINE.match(line)), lines[-1] if lines else "")


def logged_failure(log: Path, marker: str, tail_bytes: int = 262144) -> str:
    """The last log record of ``log`` that contains ``marker``, with the lines that follow it (a traceback) up to
    the next record (a line that starts with a date); "" when there is none."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, log.stat().st_size - tail_bytes))
            lines = file.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if marker in line]
    if not starts:
        return ""
    block = [lines[starts[-1]]]
    for line in lines[starts[-1] + 1 :]:
        if _RECORD_START.match(line):
            break
        block.append(line)
    return "\n".join(block).rstrip()


_RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d ")  # relayrl.cli's log format starts each record with its date


def read_restarts(run_dir: Path) -> dict[str, int]:
    """role -> restarts so far, from the supervisor's state file ({} when there is none). A file that cannot be
    read is logged at WARNING naming it and the error ({}): it is written atomically, so it is damaged, and
    status must not read that as zero restarts unseen."""
    path = run_dir / STATE_FILE
    try:
        roles = json.loads(path.read_text())["roles"]
        return {role: int(entry["restarts"]) for role, entry in roles.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("%s is unreadable (%s: %s): restarts unknown", path, type(err).__name__, err)
        return {}


class Supervisor:
    """``job``: the launcher's LocalJob (``children``, ``respawn(role)``, ``logs``); ``run_dir`` gets the state file."""

    def __init__(
        self,
        job,
        cfg: SupervisorConfig,
        run_dir: Path,
        *,
        on_event: Callable[[str], None] = log.warning,
        run_stopped: Callable[[], str] = str,
    ) -> None:
        """``run_stopped()``: why the run was stopped for good ("" while it was not), asked when the trainer dies."""
        self.job, self.run_dir, self.on_event, self.run_stopped = job, run_dir, on_event, run_stopped
        self.budget = RestartBudget(cfg)
        self.due: dict[str, float] = {}  # role -> when its restart is due (monotonic)
        self.exit_codes: dict[str, list[int]] = {}
        self._written: dict[str, int] = {}
        self.write_state()

    def died(self, role: str) -> bool:
        code = self.job.children[role].poll()
        return code is not None and not (role == "trainer" and code == 0)

    def tick(self, leave: Container[str] = ()) -> None:
        """Schedule or perform the restarts that are due; roles in ``leave`` (being stopped on purpose) are not
        touched. Raises RestartBudgetExhausted for a role that died once more than its budget allows."""
        now = time.monotonic()
        for role in list(self.job.children):
            if role in leave or not self.died(role):
                continue
            if role not in self.due:
                code = self.job.children[role].returncode
                self.exit_codes.setdefault(role, []).append(code)
                logfile = self.job.logs / f"{role}.log"
                if code == NO_RESTART_CODE:
                    self.write_state()
                    why = f"{role} refused to start (exit code {code}): {last_error(logfile)} (log: {logfile})"
                    raise RunStopped(why)
                if role == "trainer" and (why := self.run_stopped()):
                    self.write_state()
                    raise RunStopped(why)
                if self.budget.exhausted(role):
                    self.write_state()
                    raise RestartBudgetExhausted(
                        f"{role} exited with code {code} after {self.budget.counts.get(role, 0)} restarts "
                        f"(supervisor.max_restarts = {self.budget.cfg.max_restarts}): {last_error(logfile)} "
                        f"(log: {logfile})"
                    )
                self.due[role] = now + self.budget.delay_s(role)
                self.on_event(
                    f"{role} exited with code {code}; restart {self.budget.counts.get(role, 0) + 1}/"
                    f"{self.budget.cfg.max_restarts} in {self.budget.delay_s(role):.1f}s (log: {logfile})"
                )
            elif now >= self.due[role]:
                del self.due[role]
                self.budget.record(role)
                self.job.respawn(role)
                self.on_event(f"{role} restarted (pid {self.job.children[role].pid})")
        if {role: proc.pid for role, proc in self.job.children.items()} != self._written:
            self.write_state()  # a restart, or a worker the scaler started or stopped

    def write_state(self) -> None:
        self._written = {role: proc.pid for role, proc in self.job.children.items()}
        roles = {
            role: {
                "pid": proc.pid,
                "restarts": self.budget.counts.get(role, 0),
                "exit_codes": self.exit_codes.get(role, []),
                "log": str(self.job.logs / f"{role}.log"),
            }
            for role, proc in self.job.children.items()
        }
        path = self.run_dir / STATE_FILE
        atomic_write(path, json.dumps({"roles": roles}, indent=2))
