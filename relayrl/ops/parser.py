"""Argument parsers of the operator commands; the implementations load lazily (relayrl.ops.commands)."""

from __future__ import annotations

import argparse
import os

from relayrl.ops.args import (
    address,
    existing_dir,
    existing_file,
    non_negative_float,
    positive_float,
    positive_int,
    top_p,
)


def _lazy(name: str):
    def run(args: argparse.Namespace) -> int:
        from relayrl.ops import commands

        return getattr(commands, name)(args)

    return run


def _connection(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection (the token comes from RELAYRL_AUTH_TOKEN only)")
    group.add_argument(
        "--controller",
        type=address,
        default=None,
        help="controller host:port (default: RELAYRL_CONTROLLER, else the --run directory's controller.address)",
    )
    group.add_argument(
        "--run", type=existing_dir, default=None, help="a run directory of `relayrl up` (runs/NAME): its controller"
    )
    group.add_argument("--json", action="store_true", help="machine-readable output")
    group.add_argument(
        "--timeout", type=positive_float, default=None, help="deadline of each call in seconds, retries included"
    )
    group.add_argument("--attempts", type=positive_int, default=5, help="tries of a call that fails with UNAVAILABLE")
    group.add_argument(
        "--tls-ca", type=existing_file, default=None, help="CA bundle (PEM) that signs the controller's certificate"
    )
    group.add_argument("--tls-cert", type=existing_file, default=None, help="client certificate (PEM), for mTLS")
    group.add_argument("--tls-key", type=existing_file, default=None, help="client private key (PEM), for mTLS")
    group.add_argument("--tls-server-name", default=None, help="name expected in the controller's certificate")


def add_operator_commands(sub: argparse._SubParsersAction) -> None:
    """``submit``, ``status``, ``weights sync|status``, ``pause``, ``unpause`` (alias ``resume``), ``drain``,
    ``scale rollout``."""
    p = sub.add_parser("submit", help="sample completions for the prompts of a JSONL file")
    p.add_argument(
        "prompts",
        type=existing_file,
        help='JSONL: {"prompt": ..., "answer": ..., "id": ...} per line (no id: line-<N>; no answer: no reward)',
    )
    p.add_argument("--n", type=positive_int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=positive_int, default=16)
    p.add_argument("--temperature", type=non_negative_float, default=1.0)
    p.add_argument("--top-p", type=top_p, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--reward-fn", default="", help="registered reward function: adds each completion's reward")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--out", default=None, help="write completions here as JSONL (default: stdout)")
    p.add_argument(
        "--unordered", action="store_true", help="write each completion as it arrives (default: in input order)"
    )
    _connection(p)
    p.set_defaults(func=_lazy("cmd_submit"))

    p = sub.add_parser("status", help="the run: state, step/total, reward, samples/s, ETA, workers, ledger")
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until the run ends or Ctrl-C; with --json one object a line",
    )
    _connection(p)
    p.set_defaults(func=_lazy("cmd_status"))

    weights = sub.add_parser("weights", help="policy weights on the workers").add_subparsers(
        dest="action", required=True
    )
    p = weights.add_parser("sync", help="ask the trainer to push its current weights to every worker now")
    p.add_argument("--force", action="store_true", help="re-form the broadcast group first")
    p.add_argument("--no-wait", action="store_true", help="return once the request is queued")
    p.add_argument("--wait-timeout", type=positive_float, default=120.0, help="seconds to wait for the trainer")
    _connection(p)
    p.set_defaults(func=_lazy("cmd_weights_sync"))
    p = weights.add_parser("status", help="every worker's loaded version and the recent syncs")
    _connection(p)
    p.set_defaults(func=_lazy("cmd_weights_status"))

    p = sub.add_parser("pause", help="stop producing batches; workers stop admitting Generate calls")
    p.add_argument("--reason", default="", help="logged by the controller and the workers")
    _connection(p)
    p.set_defaults(func=_lazy("cmd_pause"))
    p = sub.add_parser("unpause", help="undo pause: batches and Generate calls start again")
    _connection(p)
    p.set_defaults(func=_lazy("cmd_unpause"))
    p = sub.add_parser(
        "resume", help="alias of unpause (to continue a stopped run: relayrl up CONFIG --resume)"
    )  # the command's first name, kept for scripts
    _connection(p)
    p.set_defaults(func=_lazy("cmd_unpause"), alias_of="unpause")

    p = sub.add_parser("drain", help="give a worker no new work; its in-flight calls finish")
    p.add_argument("worker", help="worker id (see relayrl status)")
    p.add_argument("--wait", action="store_true", help="return once its in-flight calls finished")
    p.add_argument("--wait-timeout", type=positive_float, default=300.0)
    _connection(p)
    p.set_defaults(func=_lazy("cmd_drain"))

    scale = sub.add_parser("scale", help="change the number of workers").add_subparsers(dest="action", required=True)
    p = scale.add_parser("rollout", help="set the desired number of rollout workers")
    p.add_argument("replicas", type=positive_int)
    p.add_argument(
        "--k8s-namespace",
        default=os.environ.get("RELAYRL_K8S_NAMESPACE"),
        help="patch this namespace's StatefulSet instead (default: RELAYRL_K8S_NAMESPACE)",
    )
    p.add_argument(
        "--statefulset",
        default=os.environ.get("RELAYRL_ROLLOUT_STATEFULSET"),
        help="the rollout StatefulSet (default: RELAYRL_ROLLOUT_STATEFULSET)",
    )
    p.add_argument(
        "--slurm-job",
        default=None,
        help="start or stop rollout job steps in this running relayrl.sbatch het job instead",
    )
    p.add_argument(
        "--slurm-run-dir",
        default=None,
        help="the job's RUN_DIR (default: what the job recorded in its Comment, else RELAYRL_RUN_DIR)",
    )
    p.add_argument(
        "--drain-timeout",
        type=positive_float,
        default=300.0,
        help="Kubernetes/Slurm: wait this long for drained workers",
    )
    _connection(p)
    p.set_defaults(func=_lazy("cmd_scale_rollout"))
    p = scale.add_parser("reward", help="set the desired number of servers of a scorer (scorers.<name>)")
    p.add_argument("replicas", type=positive_int)
    p.add_argument("--name", required=True, help="the scorer's key in the run's scorers section")
    _connection(p)
    p.set_defaults(func=_lazy("cmd_scale_reward"))
