"""relayrl.runtime.forkserver: roles forked from one interpreter are the launcher's own processes, with their own
session, command line, environment, log and exit status, and outlive the server."""

from __future__ import annotations

import gc
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest

from relayrl.config import RelayConfig, parse_config
from relayrl.launcher import LocalJob, RoleStart, modeling_source
from relayrl.models.assets import prepare_assets
from relayrl.runtime import forkserver
from relayrl.runtime.forkserver import (
    RELAY,
    ROLE_PRELOAD,
    SERVER_ROLES,
    ForkedRole,
    ForkServer,
    Preloader,
    env_fork_blockers,
    model_module,
)

# The launcher's side, run in a process of its own: it becomes a child subreaper, which a test process must not.
DRIVER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    from relayrl.runtime.forkserver import RELAY, ForkServer

    logs, config = Path(sys.argv[1]), sys.argv[2]
    server = ForkServer.start(None)  # as `relayrl up` starts it, before its last check and its run directory
    server.log_to(logs / "forkserver.log")
    env = {**server.env, "RELAYRL_LOG_LEVEL": "DEBUG"}
    out = {"launcher": os.getpid()}
    bad = server.spawn("bad", [*RELAY, "controller", "serve", "--config", str(logs / "missing.yaml")], env,
                       logs / "bad.log")
    out["bad_code"] = bad.wait(timeout=120)
    out["refused"] = server.spawn("x", [*RELAY, "--help"], {**env, "OMP_WAIT_POLICY": "PASSIVE"}, logs / "x.log")
    out["refused_why"] = server.refused["x"]
    out["other"] = server.spawn("z", ["/bin/true"], env, logs / "z.log")
    out["other_why"] = server.refused["z"]
    serve = [*RELAY, "controller", "serve", "--config", config, "--port", "0"]
    role = server.spawn("controller", serve, env, logs / "controller.log")
    deadline = time.monotonic() + 120
    while "listening on port" not in (logs / "controller.log").read_text() and time.monotonic() < deadline:
        assert role.poll() is None, (logs / "controller.log").read_text()
        time.sleep(0.1)
    stat = Path(f"/proc/{role.pid}/stat").read_text().rsplit(")", 1)[1].split()
    out["ppid"], out["sid"], out["pid"] = int(stat[1]), os.getsid(role.pid), role.pid
    out["cmdline"] = Path(f"/proc/{role.pid}/cmdline").read_bytes().replace(b"\\0", b" ").decode().strip()
    server.kill()  # the servers die; the role one forked goes on
    time.sleep(1.0)
    out["alive_after_server"] = role.poll() is None
    out["after_server"] = server.spawn("y", [*RELAY, "--help"], env, logs / "y.log")
    out["after_server_why"] = server.refused["y"]
    os.kill(role.pid, signal.SIGTERM)
    out["code"] = role.wait(timeout=60)
    print(json.dumps(out))
    """
)


def test_runtime_variables_fork_and_load_time_ones_do_not():
    server = {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE", "HF_HOME": "/h"}
    runtime = {"RELAYRL_COLOCATED": "1", "CUDA_VISIBLE_DEVICES": "3", "RANK": "0", "OMP_NUM_THREADS": "2"}
    assert env_fork_blockers({**server, **runtime}, server) == []
    assert env_fork_blockers({**server, "OMP_WAIT_POLICY": "PASSIVE"}, server) == ["OMP_WAIT_POLICY"]
    assert env_fork_blockers({"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE"}, server) == ["HF_HOME"]  # removed counts
    assert env_fork_blockers({**server, "MALLOC_ARENA_MAX": "2", "A": "1"}, server) == ["A", "MALLOC_ARENA_MAX"]


def test_the_modeling_and_configuration_modules_come_from_the_model_type(tiny_model_dir, tmp_path):
    assert model_module(tiny_model_dir) == "transformers.models.qwen2.modeling_qwen2"
    assert model_module(tiny_model_dir, "configuration") == "transformers.models.qwen2.configuration_qwen2"
    assert model_module(tmp_path) is None  # no config.json: nothing extra preloaded


def test_a_builtin_model_preloads_the_modeling_module_of_its_build(tmp_path):
    def config() -> RelayConfig:
        return parse_config({"run": {"dir": str(tmp_path)}, "model": {"path": "builtin:tiny-qwen2"},
                             "data": {"path": "builtin:digits"}})  # fmt: skip

    prepare_assets(config())  # built once per machine (the asset cache): a later run's server reads its config.json
    assert model_module(modeling_source(config())) == "transformers.models.qwen2.modeling_qwen2"


def test_a_forked_role_is_the_launchers_own_process(make_config, tmp_path):
    config = make_config("forked")
    logs = tmp_path / "logs"
    logs.mkdir()
    done = subprocess.run([sys.executable, "-c", DRIVER, str(logs), str(config)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # an error of the role is its exit code and its log, as for `python -m relayrl.cli`
    assert out["bad_code"] == 2 and "--config" in (logs / "bad.log").read_text()  # the one-line refusal
    # an environment a library reads when it loads is not forked: the launcher starts that role fresh
    assert out["refused"] is None and out["refused_why"] == ["OMP_WAIT_POLICY"]
    assert out["other"] is None and out["other_why"] == ["not a relayrl.cli command"]  # forks run relayrl.cli only
    # the role: the launcher's child (double fork, subreaper), its own session, its own command line
    assert out["ppid"] == out["launcher"] and out["sid"] == out["pid"]
    assert out["cmdline"].endswith(f"-m relayrl.cli controller serve --config {config} --port 0"), out["cmdline"]
    log = (logs / "controller.log").read_text()
    assert " DEBUG " in log  # its environment (RELAYRL_LOG_LEVEL) reached it
    # the server's imports reached it frozen out of garbage collection (runtime/gcfreeze.py), and it froze its own
    frozen = re.search(r"controller: (\d+) startup objects frozen .*\((\d+) of them by the fork server\)", log)
    assert frozen and int(frozen[1]) > int(frozen[2]) > 100_000, log
    # the server's death stops no role, and later roles are refused (started fresh) with the reason
    assert out["alive_after_server"] and out["after_server"] is None
    assert out["after_server_why"] == ["fork server exited with code -9"]
    assert out["code"] == 0 and "SIGTERM: shutting down the controller" in log
    # the server's own log: what it wrote before `log_to` named it (its first import), and after (each fork)
    server_log = (logs / "forkserver.log").read_text()
    assert re.match(r"fork server \((service|model)\): imported relayrl.cli in ", server_log), server_log
    assert f"fork server (service): forked pid {out['pid']}: controller serve" in server_log


def test_a_gpu_host_or_the_switch_starts_roles_fresh(tmp_path, monkeypatch):
    from relayrl.config import RelayConfig
    from relayrl.launcher import start_forks

    cfg = RelayConfig.model_validate({"model": {"path": "m"}, "data": {"path": "d"}})
    off = cfg.model_copy(update={"supervisor": cfg.supervisor.model_copy(update={"fork_roles": False})})
    assert start_forks(off) is None
    driver = tmp_path / "nvidiactl"
    driver.touch()
    monkeypatch.setattr("relayrl.launcher.GPU_DRIVER_NODES", (str(driver),))  # CUDA does not survive a fork
    assert start_forks(cfg) is None


def test_a_waiting_request_is_served_first_and_every_roles_modules_are_imported_while_idle(monkeypatch):
    """The launcher's first request (the controller) is answered before the server imports what later roles
    need; with nothing asked, it imports the rest in ROLE_PRELOAD order (imports and forks recorded, not run)."""
    events: list[str] = []

    def recorded_import(self, name: str) -> None:
        if name not in self.done:
            self.done.add(name)
            events.append(name)

    monkeypatch.setattr(Preloader, "_import", recorded_import)
    monkeypatch.setattr(forkserver, "_fork_role", lambda request: events.append(f"fork {request['args'][0]}") or 1)
    read_end, write_end = os.pipe()
    os.write(write_end, json.dumps({"args": ["controller", "serve"], "env": {}, "log": "unused"}).encode() + b"\n")
    os.close(write_end)  # the launcher closes the pipe: the server stops
    with os.fdopen(read_end, "rb") as requests:
        try:
            assert forkserver.serve(None, requests, io.BytesIO()) == 0
        finally:
            gc.enable()  # serve() disables it for the server's imports
    assert events == ["relayrl.services.controller_server", "fork controller"]

    events.clear()
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as requests:
        monkeypatch.setattr(forkserver.select, "select", lambda r, w, x, timeout: ([], [], []))  # nothing asked yet
        os.close(write_end)
        try:
            forkserver.serve(None, requests, io.BytesIO())
        finally:
            gc.enable()
    every = [name for names in ROLE_PRELOAD.values() for name in names if name not in forkserver.MODEL_MODULES]
    assert events == every

    events.clear()  # a server of some roles only (SERVER_ROLES) imports theirs
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as requests:
        os.close(write_end)
        try:
            forkserver.serve(None, requests, io.BytesIO(), roles=("rollout", "trainer"))
        finally:
            gc.enable()
    model_roles = [*ROLE_PRELOAD["rollout"], *ROLE_PRELOAD["trainer"]]
    assert events == [name for name in dict.fromkeys(model_roles) if name not in forkserver.MODEL_MODULES]


def test_the_roles_that_load_the_model_go_to_one_server_and_every_other_command_to_the_other():
    """Two servers import side by side (SERVER_ROLES): the model server preloads the modeling module and forks the
    rollout workers and the trainer; the service server takes the start-up checks and everything else."""
    servers = ForkServer({name: object() for name in SERVER_ROLES}, env={})
    assert set(SERVER_ROLES) == {"service", "model"}
    for args, name in [(["rollout", "serve"], "model"), (["trainer", "launch"], "model"), (["trainer", "run"], "model"),
                       (["controller", "serve"], "service"), (["env", "serve"], "service"),
                       (["scorer", "serve"], "service"), ([], "service")]:  # fmt: skip
        assert servers.server_for(args) is servers.servers[name], args
    modeled = {role for role, modules in ROLE_PRELOAD.items() if forkserver.MODEL in modules}
    assert modeled == set(SERVER_ROLES["model"]) and not modeled & set(SERVER_ROLES["service"])


class CallsHere:
    """``ForkServer.call`` answered by ``_call`` in this process, as the server answers it; or ``reply``."""

    def __init__(self, reply: dict | None = None) -> None:
        self.reply, self.calls = reply, []

    def call(self, function: str, arg: str) -> dict:
        self.calls.append(function)
        return self.reply or forkserver._call({"call": function, "arg": arg})


def test_relayrl_ups_heavy_checks_run_in_its_fork_server_and_refuse_there_as_here(make_config, monkeypatch):
    """``heavy_checks`` with a fork server asks it to run them (on the config as ``dump_config`` writes it); its
    refusal is the same ConfigError line; a server that cannot answer, or an error that is no refusal, has them run
    here."""
    from relayrl.config import ConfigError, load_config
    from relayrl.ops import preflight

    good, bad = load_config(make_config("good")), load_config(make_config("bad", algorithm={"advantage": "gea"}))
    with pytest.raises(ConfigError) as here:
        preflight.heavy_checks(bad)
    server = CallsHere()
    with pytest.raises(ConfigError) as there:
        preflight.heavy_checks(bad, server)
    assert str(there.value) == str(here.value) and str(here.value).startswith("algorithm.advantage: unknown")
    assert server.calls == ["relayrl.ops.preflight:heavy_checks_of"]
    assert forkserver._call({"call": "json:loads", "arg": "{"})["raised"] == "json.decoder.JSONDecodeError"
    checked = []
    monkeypatch.setattr(preflight, "HEAVY_CHECKS", (checked.append,))
    preflight.heavy_checks(good, server)
    assert checked == [good]  # the server's config is this one
    preflight.heavy_checks(good, CallsHere({"ok": True}))
    assert checked == [good]  # the server checked it: nothing ran here
    preflight.heavy_checks(good, CallsHere({"error": "fork server closed its pipe"}))
    preflight.heavy_checks(good, CallsHere({"raised": "builtins.OSError", "message": "no space left"}))
    assert checked == [good] * 3


def test_each_model_module_is_named_only_when_a_role_that_needs_it_comes(monkeypatch):
    """Naming one imports transformers' auto classes: a role whose modules come first does not wait for that. The
    controller's tokenizer load imports the configuration module; the model roles import the modeling module."""
    named: list[tuple[str, str]] = []
    monkeypatch.setattr(forkserver, "model_module", lambda path, kind: named.append((path, kind)) or f"{kind}_x")
    monkeypatch.setattr(Preloader, "_import", lambda self, name: self.done.add(name))
    preloader = Preloader("/models/x")
    preloader.prepare("env")
    assert named == []
    preloader.prepare("controller")
    assert named == [("/models/x", "configuration")] and "configuration_x" in preloader.done
    preloader.prepare("rollout")
    preloader.prepare("trainer")
    assert named == [("/models/x", "configuration"), ("/models/x", "modeling")] and "modeling_x" in preloader.done
    assert Preloader(None).named(forkserver.CONFIG) is None  # no model directory: nothing extra preloaded


def test_a_fork_server_still_importing_holds_up_only_its_own_roles(tmp_path):
    """``relayrl up`` asks the two servers side by side: the controller's server, busy until the model server has
    forked the trainer, does not keep the model server's roles waiting; ``children`` keeps the order asked."""
    trainer_forked = threading.Event()

    class TwoServers:
        """The part of ``ForkServer`` that ``LocalJob`` uses, answering at once but for the controller."""

        env, pids, refused = dict(os.environ), set(), {}

        def server_for(self, args: list[str]) -> str:
            return "service" if args[0] == "controller" else "model"

        def spawn(self, role, argv, env, log) -> ForkedRole:
            if role == "controller":
                assert trainer_forked.wait(30), "the model server's roles waited for the service server"
            if role == "trainer":
                trainer_forked.set()
            return ForkedRole(os.getpid(), list(argv))

    job = LocalJob(parse_config({"model": {"path": "m"}, "data": {"path": "d"}}), tmp_path / "c.yaml", tmp_path)
    job.forks = TwoServers()
    job.spawn_side_by_side([RoleStart(role, [*RELAY, role.split("-")[0], "serve"]) for role in
                            ("controller", "rollout-0", "trainer")])  # fmt: skip
    assert list(job.children) == ["controller", "rollout-0", "trainer"]
