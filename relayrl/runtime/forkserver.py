"""Fork servers for ``relayrl up``: roles forked from interpreters that imported torch once.

Every role of a local run is a Python process that imports torch, transformers, datasets and gRPC before it
does anything else: seconds of a core each, once per role on the way to the first step, and again at every
restart. A fork server imports them once (``ROLE_PRELOAD``, the run's modeling and configuration modules included), then
forks each role from that state. Two servers share the roles (``SERVER_ROLES``) and import side by side: the
service server (the start-up checks, the controller, environments) and the model server (the roles that load
the model: rollout workers and the trainer), so the imports on the way to the first step take two cores, not
one. A forked role is still its own OS process in its own session, with its own log, environment and command
line (``setproctitle``, as vLLM's ``set_process_title`` in vllm/utils/system_utils.py names its processes); it
runs ``relayrl.cli.main`` exactly as ``python -m relayrl.cli`` would.

Contract:
- Double fork: the role is the grandchild of the server and, once the intermediate process exits, a child of
  the launcher, which is a child subreaper (``PR_SET_CHILD_SUBREAPER``, prctl(2)). The launcher waits for it,
  reads its exit status and signals it as if it had started it itself (``ForkedRole``), and the server's
  death stops no role.
- The server forks only with no Python thread but its main one running, and never touches CUDA or gRPC
  channels: native pools that exist at import (OpenBLAS, jemalloc) have their own ``pthread_atfork`` handlers.
  The launcher starts no fork server on a GPU host (``relayrl.launcher.start_forks``).
- An environment that differs from the server's in anything but ``RUNTIME_ENV`` is not forked
  (``ForkServer.spawn`` returns None and the launcher starts a fresh interpreter): libraries read some variables
  once when they load, OMP_WAIT_POLICY by libgomp when torch loads, for one.
- The launcher may have a function run in the service server (``ForkServer.call``): ``relayrl up``'s start-up
  checks that import torch and transformers, which its roles import anyway. Its reply is what it raised, if any.
- Random state: CPython reseeds ``random`` in a forked child (``os.register_at_fork``); NumPy's global
  generator is reseeded here from the OS, as a fresh process's is. torch's default seed is a constant.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NoReturn

from setproctitle import setproctitle

from relayrl.runtime.procs import PARENT_ENV, become_subreaper, exit_now, stop_with_parent

ENTRY_MODULE = "relayrl.cli"  # every role's entry point, ``main(argv)``; named, not imported: the CLI imports this
RELAY = (sys.executable, "-m", ENTRY_MODULE)  # every role's command line: RELAY + its arguments

# what each role imports before its first step (cli.py's cmd_*), by the first word of its command; MODEL is
# the run's modeling module, CONFIG its configuration module (the controller's tokenizer load imports it through
# AutoConfig: torch.distributed.tensor and sympy come with it, a second of a core). A server imports those of its
# roles (SERVER_ROLES) in this order, from its start and between requests (``serve``); the launcher asks each
# server for its roles side by side (``LocalJob.spawn_side_by_side``), so a role's request waits for its own modules
# and at most for the one import in progress of its own server.
MODEL, CONFIG = "<modeling module>", "<configuration module>"
MODEL_MODULES = {MODEL: "modeling", CONFIG: "configuration"}  # placeholder -> its ``model_module`` kind
ROLE_PRELOAD = {
    "controller": ("relayrl.services.controller_server", CONFIG),
    "rollout": ("relayrl.services.rollout_server", "relayrl.rollout.hf", MODEL),
    "trainer": ("relayrl.trainer.loop", MODEL),
    "env": ("relayrl.env.server",),  # the environment's own module is imported by the role
}
# server name -> the roles it forks (by their command's first word); any other command goes to the first one
SERVER_ROLES = {"service": ("controller", "env"), "model": ("rollout", "trainer")}
# variables read at run time only (by relayrl, torch.distributed's env:// rendezvous, the CUDA driver at cuInit).
# OMP_NUM_THREADS is one for a role: each sets its torch threads itself (torch.set_num_threads sets OpenMP's and
# MKL's), and the one library left that reads it at load is NumPy's OpenBLAS, which no role does its math with.
RUNTIME_ENV_PREFIXES = ("RELAYRL_",)
RUNTIME_ENV = frozenset({
    "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "OMP_NUM_THREADS",
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
})  # fmt: skip
REPARENT_TIMEOUT_S = 5.0


def model_module(model_path: str | Path, kind: str = "modeling") -> str | None:
    """``transformers.models.<m>.<kind>_<m>`` (``kind``: modeling or configuration) for the ``model_type`` in
    ``model_path``/config.json, if any."""
    try:
        model_type = json.loads((Path(model_path) / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    return f"transformers.models.{name}.{kind}_{name}"


def env_fork_blockers(env: dict[str, str], server_env: dict[str, str]) -> list[str]:
    """The variables that keep ``env`` from being forked from a server started with ``server_env`` (sorted)."""
    differ = {k for k in env.keys() | server_env.keys() if env.get(k) != server_env.get(k)}
    return sorted(k for k in differ if k not in RUNTIME_ENV and not k.startswith(RUNTIME_ENV_PREFIXES))


# ---------------------------------------------------------------------------------------------- server side


def _run_role(request: dict, log: int) -> None:
    """In the forked role: become what ``python -m relayrl.cli <args>`` with ``request['env']`` and its output on
    ``log`` would be, run it, and exit with its code. Never returns."""
    try:
        launcher = int(request["env"][PARENT_ENV])
        deadline = time.monotonic() + REPARENT_TIMEOUT_S
        while os.getppid() != launcher and time.monotonic() < deadline:  # the intermediate process is exiting
            time.sleep(0.001)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (log, 1), (log, 2)):
            os.dup2(fd, target)
        os.close(log)
        os.close(null)
        # for the life of the process: the server's reader may hold the next request in its buffer
        sys.stdin = open(os.devnull)  # noqa: SIM115
        run_forked_command(list(request["args"]), request["env"])
    except BaseException:  # whatever happens, this process must not return into the server
        traceback.print_exc()
        exit_now(1)


def run_forked_command(args: list[str], env: dict[str, str]) -> NoReturn:
    """In a forked child: become what ``python -m relayrl.cli <args>`` with environment ``env`` would be, run it,
    and exit with its code. Never returns."""
    code = 1
    try:
        setproctitle(" ".join([*RELAY, *args]))  # before the environment moves
        os.environ.clear()
        os.environ.update(env)
        entry = importlib.import_module(ENTRY_MODULE)  # imported already, unless this ran as ``python -m`` it
        sys.argv = [entry.__file__, *args]
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        gc.enable()  # the server's heap came frozen (_fork_role); what this role allocates is collected as usual
        try:
            code = entry.main(args)
        except SystemExit as done:  # argparse's errors and --help, as the interpreter would exit with them
            code = 0 if done.code is None else done.code if isinstance(done.code, int) else 1
            if not isinstance(done.code, int | None):
                print(done.code, file=sys.stderr)
        atexit._run_exitfuncs()  # the handlers the interpreter would run at exit (the server's imports' included)
    except BaseException:  # whatever happens, this process must not return into its parent's code
        traceback.print_exc()
    finally:
        exit_now(code)


def _fork_role(request: dict) -> int:
    """Fork ``request`` twice (module docstring); returns the role's pid once it is the launcher's child."""
    if threading.active_count() != 1:
        raise RuntimeError(f"{threading.active_count()} Python threads are running: forking is unsafe")
    gc.freeze()  # the role inherits the imports frozen: its collector never walks them (relayrl/runtime/gcfreeze.py)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # there once we reply
    try:
        read_end, write_end = os.pipe()
        middle = os.fork()
        if middle == 0:
            try:
                os.close(read_end)
                role = os.fork()
                if role == 0:
                    os.close(write_end)
                    os.setsid()  # its own session, process group and CFS autogroup, as start_new_session gives
                    _run_role(request, log)
                os.write(write_end, str(role).encode())
            finally:
                os._exit(0)
        os.close(write_end)
    finally:
        os.close(log)
    with os.fdopen(read_end, "rb") as pipe:
        reply = pipe.read()
    os.waitpid(middle, 0)  # exited: the role has been reparented (exit_notify reparents before notifying us)
    if not reply:
        raise RuntimeError("the intermediate process died before forking the role")
    return int(reply)


class Preloader:
    """Imports each role's ``ROLE_PRELOAD`` once: the modules of a role that asks (``prepare``), and the next ones
    of ``roles`` (every role's by default) in ``ROLE_PRELOAD`` order while the server has nothing else to do
    (``import_next``)."""

    def __init__(
        self, model_path: str | None, roles: tuple[str, ...] = tuple(ROLE_PRELOAD), label: str = "fork server"
    ) -> None:
        self.model_path, self.roles, self.label = model_path, roles, label  # label: its log lines' prefix
        self.done: set[str] = set()
        self._named: dict[str, str | None] = {}  # MODEL_MODULES -> the module names (``named``)

    def named(self, placeholder: str) -> str | None:
        """MODEL's or CONFIG's name, found when the list reaches it: naming it imports transformers' auto classes
        (a second of a core), which a role whose modules come first does not wait for."""
        if placeholder not in self._named:
            kind = MODEL_MODULES[placeholder]
            self._named[placeholder] = model_module(self.model_path, kind) if self.model_path else None
        return self._named[placeholder]

    def modules(self, role: str | None = None) -> Iterator[str]:
        """``role``'s modules (for None, those of every role of ``roles``, in order), MODEL_MODULES named, each
        once."""
        roles = [role] if role is not None else [r for r in ROLE_PRELOAD if r in self.roles]
        names = [name for r in roles for name in ROLE_PRELOAD.get(r, ())]
        for name in dict.fromkeys(names):
            name = self.named(name) if name in MODEL_MODULES else name
            if name is not None:
                yield name

    def prepare(self, role: str) -> None:
        for name in self.modules(role):
            self._import(name)

    def import_next(self) -> bool:
        """Import the next module not imported yet; False when none is left."""
        name = next((n for n in self.modules() if n not in self.done), None)
        if name is not None:
            self._import(name)
        return name is not None

    def _import(self, name: str) -> None:
        if name in self.done:
            return
        self.done.add(name)
        started = time.monotonic()
        try:
            importlib.import_module(name)
        except Exception as err:  # a module not preloaded is imported by the role itself
            print(f"{self.label}: not preloading {name}: {err}", file=sys.stderr, flush=True)
            return
        print(f"{self.label}: imported {name} in {time.monotonic() - started:.2f}s", file=sys.stderr, flush=True)


def _move_stderr(path: str) -> dict:
    """Copy what this process wrote to its stderr (a file it shares with the launcher) to ``path``, then write
    there from now on."""
    sys.stderr.flush()
    with open(path, "ab") as log:
        os.lseek(2, 0, os.SEEK_SET)
        while chunk := os.read(2, 1 << 16):
            log.write(chunk)
        log.flush()
        os.dup2(log.fileno(), 2)
    return {"ok": True}


def _call(request: dict) -> dict:
    """``request["call"]`` (``module:function``) called here with ``request["arg"]``, its prints on stderr (stdout
    carries the replies): ``{"ok": true}``, or what it raised: ``{"raised": "module.Class", "message": str(err)}``."""
    module, _, name = request["call"].partition(":")
    with contextlib.redirect_stdout(sys.stderr):
        try:
            getattr(importlib.import_module(module), name)(request["arg"])
        except Exception as err:
            return {"raised": f"{type(err).__module__}.{type(err).__qualname__}", "message": str(err)}
    return {"ok": True}


def serve(
    model_path: str | None,
    requests: IO[bytes],
    replies: IO[bytes],
    roles: tuple[str, ...] = tuple(ROLE_PRELOAD),
    label: str = "fork server",
) -> int:
    """Answer each request line ``{"args": [...], "env": {...}, "log": path}`` with ``{"pid": n}`` or
    ``{"error": text}``, importing what the role needs first (``Preloader``); ``{"stderr": path}`` moves the
    server's own output there (``_move_stderr``); ``{"call": "module:function", "arg": text}`` runs that function
    here (``_call``: relayrl up's start-up checks that import torch and transformers, which the roles need too).
    It preloads the modules of ``roles`` (``Preloader``); ``label`` starts its log lines."""
    stop_with_parent(watchdog_s=None)  # it forks: no thread may run (_fork_role); its roles run their own
    gc.disable()  # no full collections over the growing heap while it imports (relayrl/runtime/gcfreeze.py)
    started = time.monotonic()
    importlib.import_module(ENTRY_MODULE)
    print(f"{label}: imported {ENTRY_MODULE} in {time.monotonic() - started:.2f}s", file=sys.stderr, flush=True)

    preloader = Preloader(model_path, roles, label)
    while True:
        # the launcher waits for each reply before it asks again: a line is never left in ``requests``' buffer,
        # so the pipe tells whether a request waits
        while not select.select([requests], [], [], 0)[0] and preloader.import_next():
            pass
        line = requests.readline()
        if not line:
            break
        try:
            request = json.loads(line)
            if "stderr" in request:
                reply = _move_stderr(request["stderr"])
            elif "call" in request:
                started = time.monotonic()
                reply = _call(request)
                took = time.monotonic() - started
                print(f"{label}: ran {request['call']} in {took:.2f}s", file=sys.stderr, flush=True)
            else:
                preloader.prepare(request["args"][0] if request["args"] else "")
                reply = {"pid": _fork_role(request)}
                command = " ".join(request["args"][:2])
                print(f"{label}: forked pid {reply['pid']}: {command}", file=sys.stderr, flush=True)
        except Exception as err:  # a failed fork is answered; the launcher starts the role itself
            reply = {"error": f"{type(err).__name__}: {err}"}
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()
    return 0


# -------------------------------------------------------------------------------------------- launcher side


@dataclass
class ForkedRole:
    """A role the fork server started and this process inherited: the part of ``subprocess.Popen`` the
    launcher uses (pid; args: the command line it runs as; returncode: the exit code, or -N for signal N;
    poll, wait, send_signal)."""

    pid: int
    args: list[str]
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its exit status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


@dataclass
class ForkServer:
    """The launcher's handle on the fork servers (``python -m relayrl.runtime.forkserver``, one per ``SERVER_ROLES``
    entry), started with ``env``: a role goes to the server of its command's first word."""

    servers: dict[str, subprocess.Popen]  # SERVER_ROLES name -> its process
    env: dict[str, str]
    refused: dict[str, list[str]] = field(default_factory=dict)  # role -> why it was started fresh

    @classmethod
    def start(cls, model_path: str | None, keep_fds: tuple[int, ...] = ()) -> ForkServer:
        """Make this process a child subreaper and start the servers (they import while the caller goes on). Their
        output goes to temporary files until ``log_to`` names the log (the run directory may not exist yet).
        ``keep_fds``: descriptors the servers and every role they fork hold (the run's lock, runtime.runlock)."""
        become_subreaper()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
        servers = {}
        for name, roles in SERVER_ROLES.items():
            argv = [sys.executable, "-m", "relayrl.runtime.forkserver", "--name", name, "--roles", ",".join(roles)]
            if model_path and any(set(ROLE_PRELOAD.get(role, ())) & set(MODEL_MODULES) for role in roles):
                argv += ["--model", model_path]
            with tempfile.TemporaryFile() as err:
                servers[name] = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                                 env=env, start_new_session=True, pass_fds=keep_fds)  # fmt: skip
        return cls(servers, {k: v for k, v in env.items() if k != PARENT_ENV})

    @property
    def pids(self) -> set[int]:
        return {proc.pid for proc in self.servers.values()}

    def log_to(self, log: Path) -> None:
        """Append what each server wrote to its temporary file to ``log``, and its output from now on. Every server
        is asked before any answer is read: each answers once its import in progress is done."""
        live = [proc for proc in self.servers.values() if proc.poll() is None]
        for proc in live:
            _send(proc, {"stderr": str(log)})
        for proc in live:
            _receive(proc)

    def server_for(self, args: list[str]) -> subprocess.Popen:
        """The server of the command ``args`` (relayrl.cli's arguments): by its first word (``SERVER_ROLES``)."""
        word = args[0] if args else ""
        name = next((name for name, roles in SERVER_ROLES.items() if word in roles), next(iter(SERVER_ROLES)))
        return self.servers[name]

    def spawn(self, role: str, argv: list[str], env: dict[str, str], log: Path) -> ForkedRole | None:
        """``argv`` (``RELAY`` + arguments) forked with ``env`` and its output appended to ``log``; None when it
        cannot be forked (``refused[role]`` says why) and must be started as a fresh interpreter."""
        blockers = env_fork_blockers({k: v for k, v in env.items() if k != PARENT_ENV}, self.env)
        if tuple(argv[: len(RELAY)]) != RELAY:
            blockers = ["not a relayrl.cli command"]
        server = self.server_for(argv[len(RELAY) :])
        if blockers or server.poll() is not None:
            self.refused[role] = blockers or [f"fork server exited with code {server.returncode}"]
            return None
        request = {"args": argv[len(RELAY) :], "env": {**env, PARENT_ENV: str(os.getpid())}, "log": str(log)}
        reply = _ask(server, request)
        if "pid" not in reply:
            self.refused[role] = [reply["error"]]
            return None
        return ForkedRole(reply["pid"], list(argv))

    def call(self, function: str, arg: str) -> dict:
        """``function(arg)`` (``function``: ``module:name``) run in the first server: its reply (``_call``), or
        ``{"error": ...}`` when the server is gone."""
        server = next(iter(self.servers.values()))
        if server.poll() is not None:
            return {"error": f"fork server exited with code {server.returncode}"}
        return _ask(server, {"call": function, "arg": arg})

    def kill(self) -> None:
        """Stop the servers now, imports in progress or not (a run refused by its start-up checks)."""
        for proc in self.servers.values():
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the servers (roles they forked are not their children and go on)."""
        for proc in self.servers.values():
            if proc.poll() is None:
                proc.stdin.close()
        for proc in self.servers.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ask(server: subprocess.Popen, request: dict) -> dict:
    """One request line to ``server``, one reply line (``{"error": ...}`` when the server is gone)."""
    return _send(server, request) or _receive(server)


def _send(server: subprocess.Popen, request: dict) -> dict | None:
    """Write one request line to ``server``; None, or ``{"error": ...}`` when it is gone."""
    try:
        server.stdin.write(json.dumps(request).encode() + b"\n")
        server.stdin.flush()
    except OSError as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return None


def _receive(server: subprocess.Popen) -> dict:
    """Read one reply line from ``server`` (``{"error": ...}`` when it is gone)."""
    try:
        return json.loads(server.stdout.readline() or b'{"error": "fork server closed its pipe"}')
    except (OSError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {err}"}


def main(argv: list[str] | None = None) -> NoReturn:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m relayrl.runtime.forkserver", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory whose modeling module is preloaded too")
    parser.add_argument("--name", default="", help="the server's name in its log lines (SERVER_ROLES)")
    parser.add_argument("--roles", default=",".join(ROLE_PRELOAD), help="the roles whose modules it preloads")
    args = parser.parse_args(argv)
    label = f"fork server ({args.name})" if args.name else "fork server"
    roles = tuple(r for r in args.roles.split(",") if r)
    # the launcher closed the pipe: no interpreter teardown (a collection over every torch object), nothing to flush
    exit_now(serve(args.model, sys.stdin.buffer, sys.stdout.buffer, roles, label))


if __name__ == "__main__":
    main()
