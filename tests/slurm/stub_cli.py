"""A stand-in for `relayrl.cli` that speaks the CLI contract of deploy/slurm/relayrl.sbatch.

The Slurm test copies this file to ``<tmp>/relayrl/cli.py`` and submits the job from ``<tmp>``, so
``python -m relayrl.cli`` resolves to it. It checks the arguments the sbatch passes (argparse with the
exact flags of the contract; unknown flags are errors) and imitates the flows the job depends on:

- ``controller serve`` listens on ``--port`` and appends every line a client sends to
  ``<state-dir>/registrations.txt``; on SIGTERM it writes ``<state-dir>/stopped`` and exits 0.
- ``rollout serve`` listens on ``--port``, registers ``--advertise`` with the controller (tried until the
  controller listens: the workers start with it), and on SIGTERM writes ``<run dir>/stub/rollout-<port>.stopped``
  and exits 0.
- ``reward serve`` (a scorer) listens on ``--port``, then joins the controller (``scorer <name> <advertise>``,
  tried until the controller listens: scorers start before it), and on SIGTERM writes
  ``<run dir>/stub/reward-<name>-<port>.stopped`` and exits 0.
- ``trainer run`` (under torchrun) waits for a rollout worker's registration, then rank 0 writes ten lines of
  ``<run dir>/metrics.jsonl`` with a rising ``reward_mean`` and exits 0.

Every role must be given ``--set run.dir=.. --set run.name=..`` naming ``$RELAYRL_RUN_DIR`` (the run
directory of relayrl's config), as relayrl.sbatch does.

Each process records its arguments in ``<run dir>/stub/<role>-<pid>.argv.json``.

Failure knobs: ``RELAYRL_STUB_TRAINER_EXIT=N`` makes the trainer exit N after its metrics;
``RELAYRL_STUB_ROLLOUT_CRASH=1`` makes rollout workers exit 7 right after registering (and the
trainer then waits, as a real one would, until it is stopped); ``RELAYRL_STUB_TRAINER_REGISTRATIONS=N``
makes the trainer wait for N registrations (a restarted worker registers again) before its metrics, and
``RELAYRL_STUB_TRAINER_SCORER_JOINS=N`` for N scorer joins (a restarted scorer joins again).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path


def _host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def _override(assignment: str) -> tuple[str, str]:
    key, sep, value = assignment.partition("=")
    if not sep:
        raise SystemExit(f"stub: --set {assignment!r}: overrides look like key.path=value")
    return key, value


def _listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(16)
    return sock


def _wait_for_sigterm(on_stop) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    on_stop()


def controller_serve(args: argparse.Namespace) -> int:
    if args.overrides.get("controller.host") != "0.0.0.0":
        print("stub controller: not told to listen on all interfaces", file=sys.stderr)
        return 5
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    Path(args.config).read_text()
    sock = _listen(args.port)
    lock = threading.Lock()

    def accept_loop() -> None:
        while True:
            conn, _ = sock.accept()
            with conn:
                data = conn.makefile().readline().strip()
            if data:
                with lock, open(state / "registrations.txt", "a") as f:
                    f.write(data + "\n")

    threading.Thread(target=accept_loop, daemon=True).start()
    _wait_for_sigterm(lambda: (state / "stopped").write_text("SIGTERM\n"))
    return 0


def _tell_controller(controller: tuple[str, int], line: str, timeout_s: float = 120) -> bool:
    """Send ``line`` to the controller, tried until it listens (it starts with the roles that call it); False when
    it never did within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(controller, timeout=30) as conn:
                conn.sendall(f"{line}\n".encode())
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def rollout_serve(args: argparse.Namespace) -> int:
    Path(args.config).read_text()
    sock = _listen(args.port)
    del sock  # kept open until exit: the port is the worker's
    if not _tell_controller(args.controller, f"register {args.advertise[0]}:{args.advertise[1]}"):
        print("stub rollout: the controller never listened", file=sys.stderr)
        return 3
    if os.environ.get("RELAYRL_STUB_ROLLOUT_CRASH") == "1":
        return 7
    marker = args.run_dir / "stub" / f"rollout-{args.port}.stopped"
    marker.parent.mkdir(parents=True, exist_ok=True)
    _wait_for_sigterm(lambda: marker.write_text("SIGTERM\n"))
    return 0


def reward_serve(args: argparse.Namespace) -> int:
    Path(args.config).read_text()
    sock = _listen(args.port)  # open until exit: the batch script waits for this port before the controller starts
    if not _tell_controller(args.controller, f"scorer {args.name} {args.advertise[0]}:{args.advertise[1]}"):
        print("stub scorer: the controller never listened", file=sys.stderr)
        return 3
    marker = args.run_dir / "stub" / f"reward-{args.name}-{args.port}.stopped"
    marker.parent.mkdir(parents=True, exist_ok=True)
    _wait_for_sigterm(lambda: marker.write_text("SIGTERM\n"))
    sock.close()
    return 0


def trainer_run(args: argparse.Namespace) -> int:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            print(f"stub trainer: {var} not set (not started by torchrun?)", file=sys.stderr)
            return 2
    run_dir = args.run_dir
    if args.overrides.get("weight_sync.master_address") != os.environ["MASTER_ADDR"]:
        print("stub trainer: weight_sync.master_address is not torchrun's master address", file=sys.stderr)
        return 5
    registrations = run_dir / "controller" / "registrations.txt"
    wanted = {
        "register": int(os.environ.get("RELAYRL_STUB_TRAINER_REGISTRATIONS", "1")),
        "scorer": int(os.environ.get("RELAYRL_STUB_TRAINER_SCORER_JOINS", "0")),
    }
    deadline = time.monotonic() + 120
    while not (registrations.exists() and all(counted(registrations, k) >= n for k, n in wanted.items())):
        if time.monotonic() > deadline:
            print(f"stub trainer: fewer registrations than {wanted}", file=sys.stderr)
            return 3
        time.sleep(0.2)
    with socket.create_connection(args.controller, timeout=30):
        pass
    if os.environ["RANK"] == "0":
        with open(run_dir / "metrics.jsonl", "w") as f:
            for step in range(10):
                rec = {"step": step, "reward_mean": 0.1 + 0.05 * step, "world_size": os.environ["WORLD_SIZE"]}
                f.write(json.dumps(rec) + "\n")
    if os.environ.get("RELAYRL_STUB_ROLLOUT_CRASH") == "1":
        time.sleep(600)  # a trainer waiting for batches that never come
    return int(os.environ.get("RELAYRL_STUB_TRAINER_EXIT", "0"))


def counted(path: Path, kind: str) -> int:
    """The controller's lines of ``kind``: ``register`` (a rollout worker's ``register <address>``) or ``scorer`` (a
    scorer's ``scorer <name> <address>``)."""
    return sum(line.startswith(f"{kind} ") for line in path.read_text().splitlines())


def _registering_server(roles: argparse._SubParsersAction, role: str, fn) -> argparse.ArgumentParser:
    """``<role> serve``: a server the sbatch script starts on 0.0.0.0 that registers its advertised address with the
    controller (the rollout worker's and the scorer's flags alike)."""
    sub = roles.add_parser(role).add_subparsers(dest="cmd", required=True).add_parser("serve")
    sub.add_argument("--config", required=True)
    sub.add_argument("--controller", type=_host_port, required=True)
    sub.add_argument("--host", required=True, choices=["0.0.0.0"])
    sub.add_argument("--port", type=int, required=True)
    sub.add_argument("--advertise", type=_host_port, required=True)
    sub.add_argument("--metrics-port", type=int)
    sub.set_defaults(fn=fn)
    return sub


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relayrl")
    roles = p.add_subparsers(dest="role", required=True)

    ctl = roles.add_parser("controller").add_subparsers(dest="cmd", required=True).add_parser("serve")
    ctl.add_argument("--config", required=True)
    ctl.add_argument("--port", type=int, required=True)
    ctl.add_argument("--state-dir", required=True)
    ctl.add_argument("--metrics-port", type=int)
    ctl.set_defaults(fn=controller_serve)

    ro = _registering_server(roles, "rollout", rollout_serve)
    rw = _registering_server(roles, "reward", reward_serve)
    rw.add_argument("--name", required=True)

    tr = roles.add_parser("trainer").add_subparsers(dest="cmd", required=True).add_parser("run")
    tr.add_argument("--config", required=True)
    tr.add_argument("--controller", type=_host_port, required=True)
    tr.set_defaults(fn=trainer_run)

    for sub in (ctl, ro, rw, tr):
        sub.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")

    args = p.parse_args(argv)
    args.overrides = dict(_override(o) for o in args.overrides)
    run_dir = Path(args.overrides["run.dir"]) / args.overrides["run.name"]
    if run_dir != Path(os.environ["RELAYRL_RUN_DIR"]):
        print(f"stub: run.dir/run.name = {run_dir}, expected $RELAYRL_RUN_DIR", file=sys.stderr)
        return 4
    args.run_dir = run_dir
    argv_dir = run_dir / "stub"
    argv_dir.mkdir(parents=True, exist_ok=True)
    record = {"argv": sys.argv[1:] if argv is None else argv, "rank": os.environ.get("RANK")}
    (argv_dir / f"{args.role}-{os.getpid()}.argv.json").write_text(json.dumps(record))
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
