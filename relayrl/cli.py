"""``relayrl`` command line: one entry point for every role, the launcher and the operator tools."""

# ruff: noqa: E402  (a Ctrl-C handler is installed before the imports that take seconds)

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path


def _interrupted_while_importing(_signum, _frame) -> None:
    """Ctrl-C during this module's imports (seconds on a busy machine): one line and 128 + SIGINT, no traceback
    (nothing has been made yet). ``main`` hands SIGINT back to Python before any command runs."""
    os.write(2, b"relayrl: interrupted\n")
    os._exit(130)


AS_PROGRAM = __name__ == "__main__" or os.path.basename(sys.argv[0]) == "relayrl"  # not a library's import
if AS_PROGRAM and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_importing)

import grpc

from relayrl.config import ConfigError, RelayConfig, load_config
from relayrl.controller.ledger import LedgerError
from relayrl.cores.threads import pin_role, yield_cores_to_generation
from relayrl.ops.args import (
    OneLineParser,
    address,
    existing_file,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)
from relayrl.ops.eval_commands import add_eval_commands
from relayrl.ops.parser import add_operator_commands
from relayrl.rpc.retry import STOPPING
from relayrl.runtime.gcfreeze import freeze_startup_heap, pause_collection
from relayrl.runtime.heap import retain_freed_memory
from relayrl.runtime.procs import announce, exit_now, log_native_crashes, stop_with_parent
from relayrl.runtime.runlock import RunHeld, RunLockUnsupported


def _config(args: argparse.Namespace, port_flag: str | None = None) -> RelayConfig:
    """The validated config, with the demo assets it asks for built; its ``security`` section also becomes this
    process's client security. ``port_flag``: the flag (or key) naming the port this process binds, refused
    when it is busy before anything is built or loaded."""
    from relayrl.models.assets import prepare_assets
    from relayrl.rpc.channels import configure_client

    cfg = load_config(args.config, args.set)
    if port_flag == "controller.port":
        _refuse_busy(port_flag, cfg.controller.host, cfg.controller.port)
    elif port_flag is not None:
        _refuse_busy(port_flag, getattr(args, "host", cfg.controller.host), args.port)
    if getattr(args, "metrics_port", None):
        from relayrl.services.metrics import METRICS_HOST

        _refuse_busy("--metrics-port", METRICS_HOST, args.metrics_port)
    for path in prepare_assets(cfg):
        print(f"built {path}", file=sys.stderr)
    configure_client(cfg.security)
    return cfg


def _controller(args: argparse.Namespace) -> str | None:
    """``--controller``, else RELAYRL_CONTROLLER parsed as strictly (ConfigError naming the variable)."""
    from relayrl.runtime.address import AddressError, parse_address

    if args.controller or not os.environ.get("RELAYRL_CONTROLLER"):
        return args.controller
    try:
        return str(parse_address(os.environ["RELAYRL_CONTROLLER"], "RELAYRL_CONTROLLER"))
    except AddressError as err:
        raise ConfigError(str(err)) from None


def _refuse_busy(field: str, host: str, port: int) -> None:
    """ConfigError naming ``field`` when ``host:port`` cannot be bound now (before any model is loaded)."""
    from relayrl.runtime.ports import port_in_use

    if port and (why := port_in_use(host, port)):
        raise ConfigError(f"{field}: {host}:{port} is in use ({why})")


def _add_config(parser: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        parser.add_argument("config", type=existing_file, help="run config (YAML)")
    else:
        parser.add_argument("--config", type=existing_file, required=True, help="run config (YAML)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")


def _add_resumable_config(parser: argparse.ArgumentParser, verb: str) -> None:
    """``up``/``check``: CONFIG, or ``--resume RUN_DIR`` alone; ``--allow-change KEY`` for a resume's unsafe keys."""
    parser.add_argument("config", nargs="?", type=existing_file, help="run config (YAML); none with --resume RUN_DIR")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="RUN_DIR",
        help=f"{verb} a stopped run: RUN_DIR (runs/NAME) from its saved config alone, or CONFIG's run as saved",
    )
    parser.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: let --set change KEY although it is not safe to change (recorded in resume.log)",
    )


def wait_for_shutdown() -> str:
    """Block until SIGTERM or SIGINT; returns the signal's name.

    The wait wakes every second: a process-directed signal may land on another thread, and Python runs its
    handler only when the main thread next executes bytecode, which an untimed lock wait never does. Only the
    first signal sets the event: a second one (the launcher's death and a stop together) can run its handler
    inside the first's ``Event.set``, which holds the event's lock, and setting it again there never returns."""
    received: list[str] = []
    done = threading.Event()

    def handler(signum, _frame):
        received.append(signal.Signals(signum).name)
        if len(received) == 1:
            done.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not done.wait(timeout=1.0):
        pass
    return received[0]


def cmd_controller_serve(args: argparse.Namespace) -> int:
    pause_collection()  # until its startup heap is frozen (relayrl/runtime/gcfreeze.py)
    cfg = _config(args, port_flag="controller.port" if args.port is None else "--port")
    from relayrl.services.controller_server import serve_controller  # after the checks: seconds of imports

    server, controller = serve_controller(cfg, port=args.port, state_dir=args.state_dir, metrics_port=args.metrics_port)
    freeze_startup_heap("controller")  # its startup heap (modules, tokenizer, dataset, ledger) lives as long as it does
    announce(f"controller listening on port {server.port}")
    sig = wait_for_shutdown()
    logging.info("%s: shutting down the controller", sig)
    server.stop(grace_s=cfg.controller.shutdown_grace_s)
    controller.stop()
    return 0


def cmd_rollout_serve(args: argparse.Namespace) -> int:
    pause_collection()  # until its startup heap is frozen (relayrl/runtime/gcfreeze.py)
    from relayrl.services.rollout_server import serve_rollout

    retain_freed_memory()

    cfg = _config(args, port_flag="--port")
    pin_role(cfg, "rollout")  # before any thread starts (relayrl/runtime/cpus.py)
    controller = _controller(args)
    server, worker, heartbeat = serve_rollout(
        cfg,
        controller=controller,
        host=args.host,
        port=args.port,
        advertise=args.advertise,
        worker_id=args.worker_id,
        metrics_port=args.metrics_port,
    )
    freeze_startup_heap(
        "rollout"
    )  # the engine is loaded: its heap lives as long as the worker (relayrl/runtime/gcfreeze.py)
    announce(f"rollout worker {worker.worker_id} listening on port {server.port}")
    sig = wait_for_shutdown()
    logging.info("%s: draining rollout worker %s", sig, worker.worker_id)
    worker.state = "draining"
    if heartbeat is not None:
        heartbeat.stop(deregister=True)
    server.stop(grace_s=cfg.controller.shutdown_grace_s)
    return 0


def cmd_reward_serve(args: argparse.Namespace) -> int:
    from relayrl.services.scorer_server import ControllerMembership, serve_scorer

    cfg = _config(args, port_flag="--port")
    if args.name not in cfg.scorers:
        raise ConfigError(f"--name: {args.name!r} is not a key of scorers ({', '.join(cfg.scorers) or 'none'})")
    server, worker = serve_scorer(cfg, args.name, host=args.host, port=args.port, metrics_port=args.metrics_port)
    announce(f"scorer {args.name} ({worker.model.kind}) listening on port {server.port}")
    controller = _controller(args)
    address = args.advertise or f"{'127.0.0.1' if args.host in ('0.0.0.0', '[::]') else args.host}:{server.port}"
    membership = ControllerMembership(controller, args.name, address) if controller else None
    sig = wait_for_shutdown()
    logging.info("%s: stopping scorer %s", sig, args.name)
    if membership is not None:
        membership.leave()
    server.stop(grace_s=cfg.controller.shutdown_grace_s)
    worker.stop()
    return 0


def cmd_env_serve(args: argparse.Namespace) -> int:
    from relayrl.config import SecurityConfig
    from relayrl.env.pool import busy_ports, pool_ports, run_pool
    from relayrl.env.server import EnvironmentServer, load_environment

    env_class = load_environment(args.environment)  # before any process starts: a bad name fails once
    ports = pool_ports(args.port, args.processes)
    if busy := busy_ports(args.host, ports):
        print(f"relayrl env serve: port in use: {', '.join(busy)}", file=sys.stderr)
        return 2
    if args.processes > 1:
        rest = [args.environment, "--host", args.host, "--max-sessions", str(args.max_sessions)]
        rest += ["--idle-timeout-s", str(args.idle_timeout_s), *(["--config", args.config] if args.config else [])]
        return run_pool([*rest, *(f"--set={kv}" for kv in args.set)], ports)
    security = load_config(args.config, args.set).security if args.config else SecurityConfig()
    try:
        server = EnvironmentServer(
            env_class,
            host=args.host,
            port=args.port,
            max_sessions=args.max_sessions,
            idle_timeout_s=args.idle_timeout_s,
            security=security,
        ).start()
    except OSError as err:  # taken since the check above
        print(f"relayrl env serve: {err}", file=sys.stderr)
        return 2
    announce(f"environment {server.table.name} listening on {server.address}")
    sig = wait_for_shutdown()
    logging.info("%s: stopping environment server %s", sig, server.address)
    server.stop()
    return 0


def cmd_trainer_run(args: argparse.Namespace) -> int:
    pause_collection()  # until run_trainer freezes its startup heap (relayrl/runtime/gcfreeze.py)
    controller = _controller(args)
    if not controller:
        raise ConfigError("--controller: required (or set RELAYRL_CONTROLLER)")
    retain_freed_memory()
    cfg = _config(args)
    from relayrl.trainer.loop import run_trainer  # after the config is known good: seconds of imports
    from relayrl.trainer.world import restart_attempt

    restarted = restart_attempt() > 0  # torchrun --max-restarts brought us back

    pin_role(cfg, "trainer")  # before any thread starts (relayrl/runtime/cpus.py)
    # under relayrl up: generation first on the shared cores (relayrl/cores/threads.py)
    priority = yield_cores_to_generation()
    try:
        return run_trainer(cfg, controller, resume=args.resume or restarted, priority=priority)
    except grpc.RpcError as err:
        if not STOPPING.is_set():
            raise
        logging.warning(
            "stopped: %s while the controller is stopping too; the step in progress is neither reported nor "
            "checkpointed (a resume continues from the newest checkpoint)", err.code().name,
        )  # fmt: skip
        return 0


def forkable_host() -> bool:
    """No GPU on this host: processes may be forked from one that imported torch (CUDA does not survive a fork)."""
    from relayrl.ops.placement import GPU_DRIVER_NODES

    return not any(os.path.exists(node) for node in GPU_DRIVER_NODES)


def cmd_trainer_launch(args: argparse.Namespace, rest: list[str]) -> int:
    from relayrl.trainer.launch import run_supervised

    return run_supervised(rest, fork=forkable_host())


# ``relayrl train STAGE``'s module: it has ``load_data(cfg, tokenizer)`` and ``run(cfg, resume=, data=)``
OFFLINE_STAGES = {
    "sft": "relayrl.trainer.sft",
    "dpo": "relayrl.trainer.preference",
    "rm": "relayrl.trainer.reward_trainer",
}


def cmd_train(args: argparse.Namespace) -> int:
    """``relayrl train STAGE CONFIG``: this process is the one rank (``trainer.nproc`` 1), or it starts the ranks
    (forked, or under torchrun: each of them runs this command again, as a rank) and supervises them
    (relayrl/trainer/launch.py)."""
    import importlib

    from relayrl.config import load_offline_config
    from relayrl.models.assets import prepare_model
    from relayrl.trainer.launch import run_supervised, single_rank_env
    from relayrl.trainer.loop import latest_checkpoint

    cfg = load_offline_config(args.action, args.config, args.set)
    if "RANK" not in os.environ:  # the command a user ran, not one of its ranks
        checkpoint = latest_checkpoint(cfg.run_dir)
        if checkpoint is not None and not args.resume:
            raise ConfigError(
                f"run.name: {cfg.run_dir} already has checkpoints ({checkpoint.name}); --resume continues it, or "
                "choose another run.name (or run.dir)"
            )
        prepare_model(cfg)
        if cfg.eval is not None:
            check_sft_eval(cfg)
        from transformers import AutoTokenizer

        from relayrl.trainer.offline import check_resume  # the config is good: seconds of imports

        stage = importlib.import_module(OFFLINE_STAGES[args.action])
        if args.resume:
            check_resume(cfg)

        data = stage.load_data(cfg, AutoTokenizer.from_pretrained(cfg.model.path))  # bad rows: refused before any rank
        if cfg.trainer.nproc > 1:
            rank = ["-m", "relayrl.cli", "train", args.action, args.config, *(f"--set={kv}" for kv in args.set)]
            rank += ["--resume"] if args.resume else []
            ranks = ["--standalone", f"--nproc-per-node={cfg.trainer.nproc}", *rank]
            return run_supervised(ranks, fork=forkable_host())
        os.environ.update(single_rank_env())
        return stage.run(cfg, resume=args.resume, data=data)
    prepare_model(cfg)  # a rank: the launcher built it, this points the config at it
    return importlib.import_module(OFFLINE_STAGES[args.action]).run(cfg, resume=args.resume)


def check_sft_eval(cfg) -> None:
    """``train sft``'s eval section: its RL config loads, has an eval section and passes ``relayrl eval``'s checks;
    a ConfigError naming ``eval.config`` before any rank starts."""
    from relayrl.ops.preflight import check_eval
    from relayrl.trainer.sft_eval import load_eval_config

    rl_cfg = load_eval_config(cfg)
    try:
        check_eval(rl_cfg)
    except ConfigError as err:
        raise ConfigError(f"eval.config {cfg.eval.config}: {err}") from None


def _loaded(args: argparse.Namespace) -> tuple[RelayConfig, list[str] | None]:
    """The config of ``up``/``check`` and, resuming, its changes (relayrl.ops.resume): ``--resume RUN_DIR`` reads
    the run's saved config; ``CONFIG --resume`` (or ``--resume CONFIG``) checks CONFIG against it."""
    from relayrl.ops.resume import resume_config, resume_run

    if args.allow_change and args.resume is None:
        raise ConfigError("--allow-change: only with --resume (a new run takes any config)")
    config = args.config
    if isinstance(args.resume, str):
        target = Path(args.resume)
        if config is not None:
            raise ConfigError(f"--resume {target}: give either a config file with --resume, or --resume RUN_DIR")
        if target.is_dir() or target.suffix not in (".yaml", ".yml"):
            return resume_run(target, args.set, args.allow_change)
        if not target.is_file():
            raise ConfigError(f"--resume: {target}: no such file")
        config = args.resume  # `relayrl up --resume CONFIG`: the flag before the file
    if config is None:
        raise ConfigError("config: give a run config (YAML), or --resume runs/NAME to continue a stopped run")
    if args.resume:
        return resume_config(config, args.set, args.allow_change)
    return load_config(config, args.set), None


def cmd_up(args: argparse.Namespace) -> int:
    from relayrl.launcher import claim_run, run_local, start_forks, wait_out_dead_run
    from relayrl.ops.preflight import heavy_checks, preflight
    from relayrl.rpc.channels import configure_client

    cfg, changes = _loaded(args)
    try:
        preflight(cfg, load_tokenizer=False)
    except ConfigError:
        # a run of the same name may be why (its fixed controller.port in use): a live one is refused naming it, a
        # dead launcher's processes are waited for, and then the checks run again
        if not wait_out_dead_run(cfg):
            raise
        preflight(cfg, load_tokenizer=False)
    lock = claim_run(cfg)  # before any process starts: they hold it with the launcher
    forks = None
    try:
        forks = start_forks(cfg, keep_fds=(lock.fd,))
        heavy_checks(cfg, forks)  # in the fork server when there is one: it imports torch and transformers anyway
    except BaseException:  # refused: nothing of the run may go on, nor stay created
        if forks is not None:
            forks.kill()
        if not cfg.run_dir.exists():
            lock.abandon()
        raise
    configure_client(cfg.security)
    return run_local(cfg, lock, resume=changes, forks=forks)


def cmd_check(args: argparse.Namespace) -> int:
    from relayrl.ops.preflight import preflight

    cfg, changes = _loaded(args)
    preflight(cfg)
    what = f"resumes {cfg.run_dir}" + (f" ({'; '.join(changes)})" if changes else "") if args.resume else "starts"
    print(f"{args.config or args.resume}: ok; `relayrl up` {what}")
    return 0


BENCHMARKS = {  # name -> module whose main(argv) runs it
    "weightsync": "relayrl.bench.weightsync",
    "load": "relayrl.bench.load",
    "rollout": "relayrl.bench.rollout",
    "controller": "relayrl.bench.controller",
    "e2e": "relayrl.bench.e2e",
    "guess": "relayrl.bench.guess",
    "addition": "relayrl.bench.addition",
    "reasoning-gym": "relayrl.bench.reasoning_gym_example",
    "rollout-correction": "relayrl.bench.rollout_correction",
    "padding": "relayrl.bench.padding",
    "trainer": "relayrl.bench.trainer",
    "episodes": "relayrl.bench.episodes",
    "heldout": "relayrl.bench.heldout",
    "preference": "relayrl.bench.preference",
    "humaneval": "relayrl.bench.humaneval",
    "sampling": "relayrl.bench.sampling",
    "prefix": "relayrl.bench.prefix",
    "pipeline": "relayrl.bench.pipeline",
    "sft": "relayrl.bench.sft",
    "dpo": "relayrl.bench.dpo",
    "distill": "relayrl.bench.distill",
    "scorer": "relayrl.bench.scorer",
    "tta": "relayrl.bench.tta",
}


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    return importlib.import_module(BENCHMARKS[args.which]).main(rest)


def cmd_check_engine(args: argparse.Namespace, rest: list[str]) -> int:
    from relayrl.check_engine import main

    return main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="relayrl", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("RELAYRL_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    controller = sub.add_parser("controller", help="the control plane").add_subparsers(dest="action", required=True)
    p = controller.add_parser("serve", help="serve ControllerService")
    _add_config(p)
    p.add_argument("--port", type=port, default=None, help="overrides controller.port (0 = any free port)")
    p.add_argument("--state-dir", default=None, help="ledger, cursor and versions (default <run dir>/controller)")
    p.add_argument("--metrics-port", type=port, default=None, help="serve Prometheus /metrics here (0/absent: off)")
    p.set_defaults(func=cmd_controller_serve, fast_exit=True)

    rollout = sub.add_parser("rollout", help="rollout workers").add_subparsers(dest="action", required=True)
    p = rollout.add_parser("serve", help="serve RolloutService with one engine")
    _add_config(p)
    p.add_argument("--controller", type=address, default=None, help="controller host:port (or RELAYRL_CONTROLLER)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=0)
    p.add_argument("--advertise", type=address, default=None, help="host:port others reach this worker at")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--metrics-port", type=port, default=None, help="serve Prometheus /metrics here (0/absent: off)")
    p.set_defaults(func=cmd_rollout_serve, fast_exit=True)

    env = sub.add_parser("env", help="environments for agentic episodes").add_subparsers(dest="action", required=True)
    p = env.add_parser(
        "serve",
        help="serve an Environment class over EnvironmentService",
        description="Serve module:Class (a relayrl.env.Environment subclass) over EnvironmentService. With "
        "--processes N, N server processes on ports PORT..PORT+N-1: sessions live in one process, so each "
        "process is its own address (list them all in environment.servers).",
    )
    p.add_argument("environment", help="module:Class, e.g. relayrl.env.examples.guess:GuessNumber")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=0, help="the first port (0: each process any free port)")
    p.add_argument("--processes", type=positive_int, default=1, help="server processes, on consecutive ports")
    p.add_argument("--max-sessions", type=non_negative_int, default=64, help="sessions per process (0: no limit)")
    p.add_argument("--idle-timeout-s", type=positive_float, default=600.0, help="a session idle this long is closed")
    p.add_argument(
        "--config", type=existing_file, default=None, help="run config whose security section applies (token, TLS)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.set_defaults(func=cmd_env_serve, fast_exit=True)

    reward = sub.add_parser("reward", help="reward models, judges and teachers").add_subparsers(
        dest="action", required=True
    )
    p = reward.add_parser(
        "serve",
        help="serve a scorer (scorers.<name>) over ScorerService",
        description="Serve scorers.<name> of the run config (a reward model, a judge or a teacher) over "
        "ScorerService (proto/relayrl/v1/scorer.proto); docs/reward-models.md.",
    )
    _add_config(p)
    p.add_argument("--name", required=True, help="the scorer's key in the config's scorers section")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=0)
    p.add_argument(
        "--controller",
        type=address,
        default=None,
        help="join the servers this controller calls for the scorer (a scorer added to a running run)",
    )
    p.add_argument("--advertise", type=address, default=None, help="host:port the controller reaches this scorer at")
    p.add_argument("--metrics-port", type=port, default=None, help="serve Prometheus /metrics here (0/absent: off)")
    p.set_defaults(func=cmd_reward_serve, fast_exit=True)

    trainer = sub.add_parser("trainer", help="training ranks (under torchrun)").add_subparsers(
        dest="action", required=True
    )
    p = trainer.add_parser("run", help="train: pull batches, step, broadcast weights")
    _add_config(p)
    p.add_argument("--controller", type=address, default=None, help="controller host:port (or RELAYRL_CONTROLLER)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of the run")
    p.set_defaults(func=cmd_trainer_run, fast_exit=True)

    p = trainer.add_parser(
        "launch",
        help="torchrun ARGS... under a supervisor: SIGTERM lets the ranks finish the step and exit 0",
        add_help=False,
    )
    p.set_defaults(func=cmd_trainer_launch, passthrough=True)

    train = sub.add_parser("train", help="offline training stages on the trainer").add_subparsers(
        dest="action", required=True
    )
    for name, help_text in (
        ("sft", "supervised fine-tuning on TRL-format data (docs/post-training.md)"),
        ("dpo", "DPO, IPO, conservative DPO or KTO on TRL-format preference data (docs/post-training.md)"),
        ("rm", "a reward model (Bradley-Terry) on TRL-format preference data (docs/post-training.md)"),
    ):
        p = train.add_parser(name, help=help_text)
        _add_config(p, positional=True)
        p.add_argument("--resume", action="store_true", help="continue the run from its newest checkpoint")
        p.set_defaults(func=cmd_train, fast_exit=True)

    p = sub.add_parser("up", help="run controller, rollout workers and trainer as local processes")
    _add_resumable_config(p, "continue")
    p.set_defaults(func=cmd_up, fast_exit=True)

    p = sub.add_parser("check", help="validate a run config and run the start-up checks of `relayrl up`; start nothing")
    _add_resumable_config(p, "check resuming")
    p.set_defaults(func=cmd_check)

    add_operator_commands(sub)  # submit, status, weights, pause, resume, drain, scale
    add_eval_commands(sub)  # eval, samples

    p = sub.add_parser("check-engine", help="check an inference engine against relayrl's needs", add_help=False)
    p.set_defaults(func=cmd_check_engine, passthrough=True)

    p = sub.add_parser("bench", help="benchmarks that print JSON", add_help=False)
    p.add_argument("which", choices=sorted(BENCHMARKS))
    p.set_defaults(func=cmd_bench, passthrough=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{args.command}] %(name)s: %(message)s",
    )
    stop_with_parent()  # a child of `relayrl up` stops when the launcher dies
    log_native_crashes()
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted_while_importing:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, answered below
        if getattr(args, "passthrough", False):
            return args.func(args, rest)
        code = args.func(args)
    except ConfigError as err:
        print(f"relayrl: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling (imports, checks): one line, 128 + SIGINT
        print(f"relayrl {args.command}: interrupted", file=sys.stderr)
        return 130
    except LedgerError as err:  # a corrupt line before the ledger's last: a person must look (not a restart)
        print(f"relayrl: {err}", file=sys.stderr)
        return 2
    except RunHeld as err:  # `relayrl up` of a run another live `up` holds
        print(f"relayrl: {err}", file=sys.stderr)
        return 3
    except RunLockUnsupported as err:  # the runs directory's filesystem refuses flock: a person must choose
        print(f"relayrl: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout's reader left (`relayrl samples | head`): the rest is unwanted, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush must not raise
        return 128 + signal.SIGPIPE
    if getattr(args, "fast_exit", False):
        exit_now(code)  # a process that finished cleanly skips the interpreter's teardown
    return code


if __name__ == "__main__":
    sys.exit(main())
