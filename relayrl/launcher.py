"""``relayrl up``: the controller, the rollout workers and the trainer as separate local processes.

Children run in their own sessions, so a terminal's Ctrl-C reaches only the launcher, which then
stops every child in order (trainer, workers, controller) with SIGTERM, and SIGKILL after a grace
period. Each child logs to ``<run dir>/logs/<role>.log``. While the run goes on, a child that dies is
restarted within its budget (relayrl.ops.supervise); on a GPU node each child sees only its own devices
(relayrl.ops.placement). Roles are forked from a server that imported torch once (relayrl.runtime.forkserver),
unless ``supervisor.fork_roles`` is off or a role's environment cannot be forked. Progress is a live bar on a
terminal, one line per step and per eval without one (output to a file: nohup, Slurm, CI); no line is wrapped (a
path stays one string)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from relayrl.config import BUILTIN_MODELS, RelayConfig, dump_config
from relayrl.cores.threads import COLOCATED_ENV, trainer_env
from relayrl.errors import RUN_STOPPED_DETAIL
from relayrl.models.assets import builtin_model_path, prepare_assets
from relayrl.ops.environments import environment_roles, environments_serving, start_environment_servers
from relayrl.ops.placement import GPU_DRIVER_NODES, SCORER_ROLE_PREFIX, node_devices, place
from relayrl.ops.resume import record_changes
from relayrl.ops.run_record import RunEnd
from relayrl.ops.scaler import LocalScaler
from relayrl.ops.scorers import ScorerScaler, scorers_serving, start_scorers
from relayrl.ops.supervise import RestartBudgetExhausted, RunStopped, Supervisor, last_error, logged_failure
from relayrl.rpc.channels import open_channel
from relayrl.runtime.address import Address
from relayrl.runtime.files import atomic_write
from relayrl.runtime.forkserver import RELAY, ForkedRole, ForkServer
from relayrl.runtime.ports import free_port
from relayrl.runtime.procs import ORPHAN_GRACE_S, PARENT_ENV, kill_tree, reap_orphans
from relayrl.runtime.runlock import RunLock, refuse_if_held
from relayrl.runtime.words import counted
from relayrl.trainer.launch import single_rank_env
from relayrl.trainer.metrics import eval_curves, read_evals, read_metrics, read_records
from relayrl.v1 import controller_pb2, controller_pb2_grpc

console = Console(stderr=True, soft_wrap=True)  # a long line (a path) stays whole in a log file


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class RoleStart:
    """What ``LocalJob.spawn`` takes for one role."""

    role: str
    argv: list[str]
    env: dict[str, str] | None = None
    own_store: bool = False


@dataclass
class LocalJob:
    cfg: RelayConfig
    config_path: Path
    logs: Path
    children: dict[str, subprocess.Popen | ForkedRole] = field(default_factory=dict)
    controller_address: str = ""
    devices: dict[str, str] = field(default_factory=dict)  # role -> CUDA_VISIBLE_DEVICES (GPU nodes)
    gpus: list[str] = field(default_factory=list)  # the node's devices shared out (ops.placement.node_devices)
    commands: dict[str, tuple[list[str], dict[str, str], bool]] = field(default_factory=dict)  # argv, env, own store
    forks: ForkServer | None = None
    keep_fds: tuple[int, ...] = ()  # held by every role it starts: the run's lock (runtime.runlock)

    def spawn(
        self, role: str, argv: list[str], env: dict[str, str] | None = None, *, own_store: bool = False
    ) -> subprocess.Popen | ForkedRole:
        """Start ``argv`` as ``role`` (its log appended to, its devices placed), forked when it can be
        (``ForkServer.spawn``); ``respawn`` repeats it. ``own_store``: a trainer of one rank, given at every start
        what torchrun's agent would give it (``single_rank_env``: a fresh store port each time)."""
        self.commands[role] = (list(argv), dict(env or {}), own_store)
        log = self.logs / f"{role}.log"
        placed = {"CUDA_VISIBLE_DEVICES": self.devices[role]} if role in self.devices else {}
        ours = {"PYTHONUNBUFFERED": "1", COLOCATED_ENV: "1", PARENT_ENV: str(os.getpid())}
        # a forked role's environment is the fork server's (the launcher's when it started): what libraries set in
        # the launcher since then stays out (importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR, and building
        # the demo's model imports it: every role was refused the fork and paid a fresh interpreter's imports)
        launch_env = self.forks.env if self.forks is not None else os.environ
        child_env = {**launch_env, **ours, **placed, **(env or {}), **(single_rank_env() if own_store else {})}
        proc = self.forks.spawn(role, argv, child_env, log) if self.forks is not None else None
        if proc is None:
            with log.open("ab") as log_file:  # the child holds its own descriptor
                if self.forks is not None:
                    log_file.write(f"relayrl up: {role} not forked ({', '.join(self.forks.refused[role])})\n".encode())
                proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=child_env, pass_fds=self.keep_fds)  # fmt: skip
        self.children[role] = proc
        return proc

    def spawn_side_by_side(self, starts: list[RoleStart]) -> None:
        """``spawn`` each of ``starts``: those of one fork server in order, those of different servers side by
        side, so that a server still importing holds up only its own roles."""

        def spawn_in_order(queue: list[RoleStart]) -> None:
            for start in queue:
                self.spawn(start.role, start.argv, start.env, own_store=start.own_store)

        if self.forks is None:
            spawn_in_order(starts)
            return
        queues: dict[int, list[RoleStart]] = {}
        for start in starts:
            queues.setdefault(id(self.forks.server_for(start.argv[len(RELAY) :])), []).append(start)
        with ThreadPoolExecutor(len(queues), thread_name_prefix="spawn") as pool:
            for done in [pool.submit(spawn_in_order, queue) for queue in queues.values()]:
                done.result()
        for start in starts:  # ``children`` in the order asked, whichever server answered first
            self.children[start.role] = self.children.pop(start.role)

    def rollouts(self) -> list[str]:
        return [role for role in self.children if role.startswith("rollout")]

    def respawn(self, role: str) -> subprocess.Popen | ForkedRole:
        """Start ``role`` again as it was started; the trainer continues from its newest checkpoint."""
        argv, env, own_store = self.commands[role]
        if role == "trainer" and "--resume" not in argv:
            argv = [*argv, "--resume"]
        return self.spawn(role, argv, env, own_store=own_store)

    def relay(self, *args: str) -> list[str]:
        return [*RELAY, *args]

    def reap_orphans(self) -> None:
        """Reap exited processes reparented to this subreaper that are no role (a dead role's own children)."""
        keep = {proc.pid for proc in self.children.values()}
        reap_orphans(keep | (self.forks.pids if self.forks is not None else set()))

    def close(self) -> None:
        if self.forks is not None:
            self.forks.close()

    def check_alive(self, roles: list[str]) -> None:
        for role in roles:
            proc = self.children[role]
            if proc.poll() is not None:
                log = self.logs / f"{role}.log"
                raise LaunchError(f"{role} exited with code {proc.returncode}: {last_error(log)} (log: {log})")

    def stop(self, roles: list[str] | None = None, grace_s: float = 30.0, *, in_order: bool = True) -> None:
        """Stop roles: SIGTERM a role's process group, wait up to ``grace_s``, SIGKILL the rest.

        ``in_order``: the trainer before the workers before the controller, so each can still reach what
        it reports to (workers stop together). Else every role at once: after the trainer finished its
        last step nothing is left to report, and waiting wave by wave only adds each role's exit time."""
        roles = [r for r in (roles or list(self.children)) if r in self.children]
        waves = [[r for r in roles if r == "trainer"], [r for r in roles if r.startswith("rollout")]]
        waves.append([r for r in roles if r not in waves[0] + waves[1]])
        if not in_order:
            waves = [roles]
        for wave in waves:
            for role in wave:
                if self.children[role].poll() is None:
                    os.killpg(self.children[role].pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for role in wave:
                proc = self.children[role]
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    kill_tree(proc.pid)
                    proc.wait()


def controller_status(address: str) -> controller_pb2.StatusResponse:
    stub = controller_pb2_grpc.ControllerServiceStub(open_channel(address))
    return stub.Status(controller_pb2.StatusRequest(), timeout=5)


def wait_until(predicate, timeout_s: float, what: str, job: LocalJob, roles: list[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job.check_alive(roles)
        try:
            if predicate():
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)  # on every start's path: the controller up, then each worker registered
    raise LaunchError(f"timed out after {timeout_s:.0f}s waiting for {what}")


DEAD_RUN_WAIT_S = ORPHAN_GRACE_S + 30  # a dead launcher's processes each stop within ORPHAN_GRACE_S


def _say_waiting(message: str) -> None:
    console.print(f"[yellow]{escape(message)}[/yellow]")


def claim_run(cfg: RelayConfig) -> RunLock:
    """The lock of ``cfg``'s run directory for this launcher and the processes it starts (runtime.runlock), or
    ``RunHeld``; the processes of a dead launcher are waited for while they stop."""
    lock = RunLock.take(cfg.run_dir, wait_dead_s=DEAD_RUN_WAIT_S, on_wait=_say_waiting)
    if lock.caveat:
        console.print(f"[yellow]{escape(lock.caveat)}[/yellow]")
    return lock


def wait_out_dead_run(cfg: RelayConfig) -> bool:
    """``RunHeld`` when a live run holds ``cfg``'s run directory; True once a dead launcher's processes that held
    it have stopped (waited for as ``claim_run`` does), False when none did. Creates nothing."""
    return refuse_if_held(cfg.run_dir, wait_dead_s=DEAD_RUN_WAIT_S, on_wait=_say_waiting)


def prepare_run_dir(cfg: RelayConfig, resume: list[str] | None) -> Path:
    """A fresh run directory, an existing one moved aside (never deleted), with ``cfg`` saved in it; or, resuming
    (``resume``: the safe changes, relayrl.ops.resume), the run's own, its saved config updated by them. The
    caller holds the run's lock (``claim_run``): what is moved aside is a run that no live process holds."""
    run_dir = cfg.run_dir
    if resume is not None:
        record_changes(cfg, resume)
    elif run_dir.exists():
        archived = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(run_dir), archived)
        console.print(f"[dim]previous run moved to {archived}[/dim]")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if resume is None:
        atomic_write(run_dir / "config.yaml", dump_config(cfg))
    return run_dir / "config.yaml"


def rollout_argv(job: LocalJob, index: int) -> list[str]:
    """The command line of rollout worker ``rollout-<index>``, against the job's controller."""
    argv = ["rollout", "serve", "--config", str(job.config_path), "--controller", job.controller_address]
    return job.relay(*argv, "--worker-id", f"rollout-{index}")


def spawn_rollout(job: LocalJob, index: int) -> None:
    """Start rollout worker ``rollout-<index>`` against the job's controller."""
    job.spawn(f"rollout-{index}", rollout_argv(job, index))


def start_forks(cfg: RelayConfig, keep_fds: tuple[int, ...] = ()) -> ForkServer | None:
    """The run's fork servers (runtime.forkserver), or None: ``supervisor.fork_roles`` off, no subreaper, or a GPU
    host. There torch's imports may initialise the CUDA driver in a server (``torch.cuda.is_available``
    does), and CUDA does not survive a fork; not yet measured on one, so roles start fresh. ``relayrl up``
    starts them before its last start-up check (which runs in one), their log in temporary files until
    ``start_job`` names the run's (``ForkServer.log_to``). ``keep_fds``: held by the servers and their roles."""
    if not cfg.supervisor.fork_roles:
        return None
    if any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        console.print("[dim]GPU host: roles start as fresh interpreters (no fork server)[/dim]")
        return None
    try:
        return ForkServer.start(modeling_source(cfg), keep_fds)
    except OSError as err:
        console.print(f"[yellow]roles start as fresh interpreters: {err}[/yellow]")
        return None


def modeling_source(cfg: RelayConfig) -> str:
    """The model directory whose config.json names the modeling module the fork server preloads: a ``builtin:``
    model's cached build (none yet on the run that builds it), else ``model.path``."""
    return str(builtin_model_path(cfg)) if cfg.model.path in BUILTIN_MODELS else cfg.model.path


def dial_address(host: str, port: int) -> str:
    """The address a local client dials for a server bound to ``host:port`` (a wildcard host: loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return str(Address(host, port))


def rollout_workers(cfg: RelayConfig, resume: bool) -> int:
    """How many rollout workers to start: ``rollout.workers``, or, resuming, the desired count the run's controller
    persisted (``relayrl scale rollout N``, a drain: ProgressState.desired_rollout_replicas in its state.json)
    when one was set: the count an operator chose is the source of truth, not the config's."""
    state = Path(cfg.controller.state_dir or cfg.run_dir / "controller") / "state.json"
    if resume and state.is_file():
        desired = json.loads(state.read_text()).get("desired_rollout_replicas", 0)
        if desired > 0:
            return desired
    return cfg.rollout.workers


def start_job(
    cfg: RelayConfig, config_path: Path, resume: bool, forks: ForkServer | None = None, keep_fds: tuple[int, ...] = ()
) -> LocalJob:
    """Start every role of ``cfg``, forked from ``forks`` (``start_forks``) when given, else each a fresh
    interpreter holding ``keep_fds``; the controller binds ``controller.host:port`` (a fixed port: ``run_local``
    records the one it picks for ``controller.port: 0`` in the saved config first)."""
    job = LocalJob(cfg, config_path, config_path.parent / "logs", keep_fds=keep_fds)
    job.forks = forks
    if forks is not None:
        forks.log_to(job.logs / "forkserver.log")
    job.gpus = node_devices(cfg.supervisor.gpus)
    job.devices = place(cfg, job.gpus)  # before any role starts: the scorers below are placed too
    side_roles = start_environment_servers(job)  # environment.serve: first, their addresses go into the config
    side_roles += start_scorers(job)  # scorers.<name>.replicas: likewise
    port = cfg.controller.port or free_port(cfg.controller.host)
    job.controller_address = dial_address(cfg.controller.host, port)
    common = ["--config", str(config_path)]
    # Every role starts at once (each spends seconds importing torch and loading the model): workers retry
    # their heartbeat and the trainer its first calls until the controller answers. A trainer that publishes
    # its starting weights before a worker registered finds it at version 0 (loaded from the model path).
    starts = [RoleStart("controller", job.relay("controller", "serve", *common, "--port", str(port)))]
    workers = rollout_workers(cfg, resume)
    starts += [RoleStart(f"rollout-{i}", rollout_argv(job, i)) for i in range(workers)]
    # One rank runs as the role itself, with what torchrun's agent would give it (relayrl.trainer.launch does
    # the same outside `relayrl up`); more ranks run under `relayrl trainer launch` (torchrun).
    rank = ["trainer", "run", *common, "--controller", job.controller_address, *(["--resume"] if resume else [])]
    if cfg.trainer.nproc == 1:
        starts.append(RoleStart("trainer", job.relay(*rank), trainer_env(cfg), own_store=True))
    else:
        launch = ["trainer", "launch", "--standalone", f"--nproc-per-node={cfg.trainer.nproc}", "-m", "relayrl.cli"]
        starts.append(RoleStart("trainer", job.relay(*launch, *rank), trainer_env(cfg)))
    job.spawn_side_by_side(starts)
    roles = ["controller", *(f"rollout-{i}" for i in range(workers)), "trainer", *side_roles]
    wait_until(lambda: environments_serving(job.cfg), 120, "the environment servers", job, roles)
    wait_until(lambda: scorers_serving(job.cfg), 180, "the scorers", job, roles)
    wait_until(lambda: controller_status(job.controller_address), 120, "the controller", job, roles)
    (config_path.parent / "controller.address").write_text(job.controller_address)  # for operator commands
    wait_until(
        lambda: len(controller_status(job.controller_address).workers) >= workers,
        180,
        f"{counted(workers, 'rollout worker')} to register",
        job,
        roles,
    )
    return job


def watch(job: LocalJob, metrics_path: Path) -> None:
    """Progress from metrics.jsonl until the trainer exits: a live bar on a terminal, else ``StepLines``."""
    steps = job.cfg.trainer.steps
    columns = [
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}  version {task.fields[version]}  {task.fields[sps]} samples/s"),
        TimeElapsedColumn(),
    ]
    stub = controller_pb2_grpc.ControllerServiceStub(open_channel(job.controller_address))
    progress = Progress(*columns, console=console, transient=False) if console.is_terminal else None
    lines = StepLines(steps) if progress is None else None
    with progress or nullcontext():
        say = progress.console.print if progress is not None else console.print
        scaler = LocalScaler(job, lambda k: spawn_rollout(job, k), stub, on_change=supervisor_log(job, say))
        scorers = ScorerScaler(job, stub, on_change=supervisor_log(job, say))
        supervisor = Supervisor(
            job, job.cfg.supervisor, job.cfg.run_dir, on_event=supervisor_log(job, say, label="supervisor"),
            run_stopped=lambda: run_stopped(job),
        )  # fmt: skip
        task = progress.add_task("train", total=steps, reward="-", version=0, sps="-") if progress else None
        while True:
            ended = job.children["trainer"].poll() == 0
            if not ended:
                job.reap_orphans()
                scaler.tick()  # `relayrl scale rollout N`
                scorers.tick()  # `relayrl scale reward N --name NAME`
                supervisor.tick(leave=scaler.draining)  # a dead role restarted, or the run ends here
            records = read_records(metrics_path)
            if lines is not None:
                lines.show(records)
            elif records := [r for r in records if "eval" not in r]:
                last = records[-1]
                progress.update(
                    task,
                    completed=last["step"],
                    reward=f"{last['reward_mean']:.3f}",
                    version=last["policy_version"],
                    sps=f"{last['samples_per_second']:.0f}",
                )
            if ended:
                return
            time.sleep(0.2)  # how late the run's end, or a dead role, is seen


class StepLines:
    """Progress without a terminal: one line per trained step (step/total, reward, s/step, version) and per eval,
    each printed once, as metrics.jsonl gains them."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.shown = 0  # records of metrics.jsonl already printed

    def show(self, records: list[dict]) -> None:
        for record in records[self.shown :]:
            console.print(self.line(record), highlight=False)
        self.shown = max(self.shown, len(records))

    def line(self, r: dict) -> str:
        if "eval" in r:
            metrics = ", ".join(f"{k} {v:.3f}" for k, v in r.items() if "@" in k)
            return f"eval {r['eval']} at version {r['step']}: {metrics}"
        return (
            f"step {r['step']}/{self.total} · reward {r['reward_mean']:.3f} · {r['step_seconds']:.2f} s/step · "
            f"version {r['policy_version']}"
        )


def run_stopped(job: LocalJob) -> str:
    """Why the controller stopped the run for good (relayrl.errors.RUN_STOPPED_DETAIL), with the traceback its log
    holds; "" when it did not (or cannot be asked)."""
    try:
        status = controller_status(job.controller_address)
    except grpc.RpcError:
        return ""
    if status.state != "failed" or not status.error.startswith(RUN_STOPPED_DETAIL):
        return ""
    log = job.logs / "controller.log"
    logged = logged_failure(log, status.error)
    return f"{logged or status.error}\n(log: {log})"


def failed_by_reason(job: LocalJob) -> dict[str, int]:
    """The run's failed prompts by the kind of their reason (the controller's ledger); {} when it cannot be asked."""
    try:
        return dict(controller_status(job.controller_address).ledger.failed_by_reason)
    except grpc.RpcError:
        return {}


def failure_reason(job: LocalJob) -> str:
    """The first line of the error the controller failed the run with ("" when it did not, or cannot be asked)."""
    try:
        return first_line(controller_status(job.controller_address).error)
    except grpc.RpcError:
        return ""


def first_line(text: str) -> str:
    """A message's first line (a launcher error may carry a role's traceback after it)."""
    return text.strip().split("\n", 1)[0]


def supervisor_log(job: LocalJob, say: Callable[[str], None], label: str = ""):
    """Restart and scale events go to the console (``say``; a ``label`` prefixes the line, in yellow) and to
    ``<logs>/supervisor.log``, timestamped."""

    def on_event(message: str) -> None:
        say(f"[yellow]{label}: {message}[/yellow]" if label else message)
        with (job.logs / "supervisor.log").open("a") as out:
            out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")

    return on_event


def reward_window(steps: int) -> int:
    """How many steps the summary's first and last reward means each cover: 10, or half a run shorter than 20
    steps (at least one), so that the two never share a step."""
    return max(1, min(10, steps // 2))


def heldout(metrics_path: Path) -> dict[str, dict]:
    """Each eval set's metric (mean@n, else its first pass@k) at the first and the last version it was measured:
    set -> {metric, before, before_version, after, after_version}."""
    return {
        name: {"metric": key, "before": ys[0], "before_version": xs[0], "after": ys[-1], "after_version": xs[-1]}
        for name, (key, xs, ys) in eval_curves(read_evals(metrics_path)).items()
    }


def summary(
    cfg: RelayConfig,
    metrics_path: Path,
    wall_s: float,
    failed: dict[str, int] | None = None,
    ended: RunEnd = "finished",
    reason: str = "",
) -> dict:
    """The run's summary on the console and in summary.json, written however the run ended (``ended``, and why:
    ``reason``; ``relayrl status --run`` reads it); ``failed``: failed prompts by reason."""
    records = read_metrics(metrics_path)
    failed = failed or {}
    window = reward_window(len(records))
    first, last = records[:window], records[-window:]
    result = {
        "run_dir": str(cfg.run_dir),
        "steps": len(records),
        "reward_window": window,
        "reward_start": sum(r["reward_mean"] for r in first) / max(1, len(first)),
        "reward_end": sum(r["reward_mean"] for r in last) / max(1, len(last)),
        "heldout": heldout(metrics_path),
        "wall_seconds": wall_s,
        "weight_syncs": sum(1 for r in records if r.get("workers_synced", 0) > 0),
        "sync_seconds_total": sum(r["sync_seconds"] for r in records),
        "prompts_failed": sum(failed.values()),
        "prompts_failed_by_reason": failed,
        "ended": ended,
        **({"reason": reason} if reason else {}),
    }
    table = Table(title=f"relayrl run '{cfg.run.name}'" + ("" if ended == "finished" else f" ({ended})"))
    table.add_column("metric")
    table.add_column("value", justify="right")
    if reason:
        table.add_row(ended, escape(reason))
    table.add_row("steps", str(result["steps"]))
    if len(records) > 1:
        table.add_row(f"reward, first {counted(window, 'step')}", f"{result['reward_start']:.3f}")
        table.add_row(f"reward, last {counted(window, 'step')}", f"{result['reward_end']:.3f}")
    elif records:
        table.add_row("reward", f"{result['reward_end']:.3f}")
    for name, held in result["heldout"].items():
        table.add_row(
            f"held-out: {escape(name)} {held['metric']}",
            f"{held['before']:.3f} → {held['after']:.3f} (v{held['before_version']} → v{held['after_version']})",
        )
    table.add_row("wall time", f"{wall_s:.1f} s")
    table.add_row("weight syncs", f"{result['weight_syncs']} ({result['sync_seconds_total']:.1f} s total)")
    for kind, count in sorted(failed.items(), key=lambda item: -item[1]):
        table.add_row(f"failed prompts: {escape(kind)}", str(count))
    console.print(table)
    console.print(f"run directory: {cfg.run_dir}", highlight=False)  # outside the table, whole however long
    atomic_write(cfg.run_dir / "summary.json", json.dumps(result, indent=2))
    return result


@contextmanager
def signals_deferred(*signums: int):
    """Run the block whole: these signals, should they come meanwhile, reach their handlers after it."""
    came: list[int] = []
    previous = {signum: signal.signal(signum, lambda got, _frame: came.append(got)) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if came and callable(previous[came[0]]):
        previous[came[0]](came[0], None)


def run_local(
    cfg: RelayConfig, lock: RunLock, *, resume: list[str] | None = None, forks: ForkServer | None = None
) -> int:
    """Run ``cfg`` (through relayrl.ops.preflight already) to its end under its run's ``lock`` (``claim_run``),
    its roles forked from ``forks`` when given; ``resume``: continue its stopped run, with these safe changes
    (relayrl.ops.resume). Ctrl-C exits 130, SIGTERM 0, each after stopping every role; before the roles started, a
    new run's directory is removed again."""
    started = time.monotonic()
    stop_signal: list[str] = []

    def on_signal(signum, _frame):
        stop_signal.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    job = None
    made_run_dir = False
    try:
        if not cfg.controller.port:  # saved with the run, so that its address stays when it resumes
            cfg.controller.port = free_port(cfg.controller.host)
        with signals_deferred(signal.SIGINT, signal.SIGTERM):  # the old run moved aside, the new one made: whole
            config_path = prepare_run_dir(cfg, resume)  # saved with its builtin: paths, which every role resolves
            made_run_dir = resume is None
        for path in prepare_assets(cfg):
            console.print(f"[dim]built {path}[/dim]")
        job = start_job(cfg, config_path, resume is not None, forks, keep_fds=(lock.fd,))
        console.print(
            f"controller {job.controller_address} · {counted(len(job.rollouts()), 'rollout worker')} · "
            f"trainer x{cfg.trainer.nproc} · logs in {job.logs}"
        )
        watch(job, cfg.run_dir / "metrics.jsonl")
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the stop short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stopped_by = stop_signal[0] if stop_signal else "SIGINT"
        console.print(f"[yellow]{stopped_by}: stopping every process[/yellow]")
        if job is not None:
            failed = failed_by_reason(job)  # before the controller stops
            rollouts = [r for r in job.children if r.startswith("rollout")]
            scorers = [r for r in job.children if r.startswith(SCORER_ROLE_PREFIX)]  # those scaled up too
            job.stop(["trainer", *rollouts, *environment_roles(cfg), *scorers, "controller"])
            job.close()
            reason = f"{stopped_by}: stopped by the operator; `relayrl up --resume` continues it"
            summary(cfg, cfg.run_dir / "metrics.jsonl", time.monotonic() - started, failed, "stopped", reason)
        elif forks is not None:
            forks.kill()
        if job is None and made_run_dir and cfg.run_dir.exists():  # stopped before any role started
            shutil.rmtree(cfg.run_dir, ignore_errors=True)
            lock.abandon()  # nothing of the run is left to hold
            console.print(f"[dim]removed {cfg.run_dir}: stopped before the run started[/dim]")
        else:
            lock.release()  # every role stopped
        return 0 if stop_signal else 130
    except (LaunchError, RestartBudgetExhausted, RunStopped) as err:
        failed, why = {}, first_line(str(err))
        if job is not None:
            failed, why = failed_by_reason(job), failure_reason(job) or why
            job.stop()
            job.close()
        if cfg.run_dir.is_dir():
            summary(cfg, cfg.run_dir / "metrics.jsonl", time.monotonic() - started, failed, "failed", why)
        console.print(f"[red]relayrl up failed: {escape(str(err))}[/red]")  # last: the error and its traceback
        lock.release()
        return 1
    failed = failed_by_reason(job)  # before the controller stops
    job.stop([r for r in job.children if r != "trainer"], in_order=False)
    job.close()
    lock.release()
    summary(cfg, cfg.run_dir / "metrics.jsonl", time.monotonic() - started, failed)
    return 0
