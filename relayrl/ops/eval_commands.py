"""Argument parsers of ``relayrl eval`` and ``relayrl samples``; the implementations load lazily."""

from __future__ import annotations

import argparse

from relayrl.ops.args import existing_dir, existing_file, non_negative_int, positive_int


def _eval(args: argparse.Namespace) -> int:
    from relayrl.ops.evaluate import cmd_eval

    return cmd_eval(args)


def _samples(args: argparse.Namespace) -> int:
    from relayrl.ops.samples_view import cmd_samples

    return cmd_samples(args)


def add_eval_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="score a checkpoint with a config's eval section, without training (JSON out)")
    p.add_argument("config", type=existing_file, help="run config (YAML) with an eval section")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument(
        "--checkpoint",
        type=existing_dir,
        default=None,
        help="runs/NAME/checkpoints/step_N, an exported Hugging Face directory, or a LoRA adapter (on model.path)",
    )
    p.add_argument(
        "--workers", default=None, metavar="ADDR,...", help="score what these running rollout workers hold instead"
    )
    p.add_argument(
        "--version",
        type=non_negative_int,
        default=None,
        help="the policy version to label the results with (default: the checkpoint's step, best.json's, else 0)",
    )
    p.add_argument("--out", default=None, help="also write the JSON report here")
    p.add_argument("--generations", action="store_true", help="include every prompt's generations in the report")
    p.set_defaults(func=_eval)

    p = sub.add_parser("samples", help="print a run's latest readable samples (training and eval)")
    p.add_argument("--run", type=existing_dir, required=True, help="the run directory (runs/NAME)")
    p.add_argument("--step", type=positive_int, default=None, help="this training step's samples (default: the last)")
    p.add_argument("--json", action="store_true", help="the records as JSON")
    p.add_argument("--rendered", action="store_true", help="each prompt as the model saw it too (its chat template)")
    p.set_defaults(func=_samples)
