"""Command-line argument types and a parser whose every refusal is one line naming the flag, exit code 2.

``OneLineParser`` is argparse's parser without the usage block on errors (``--help`` still shows it); its
subparsers are of the same class. The ``type=`` functions below check a value as it is parsed, so a bad one is
``relayrl <command>: error: argument --port: port 99999 is out of range 0..65535``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from relayrl.runtime.address import Address, AddressError, parse_address, parse_port, recorded_address


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def address(text: str) -> str:
    """``host:port``, strictly (relayrl.runtime.address); returned as given, normalised."""
    try:
        return str(parse_address(text, "address"))
    except AddressError as err:
        raise argparse.ArgumentTypeError(err.reason) from None


def port(text: str) -> int:
    """A port in 0..65535 (0: any free port)."""
    try:
        return parse_port(text, "port", any_port=True)
    except AddressError as err:
        raise argparse.ArgumentTypeError(err.reason) from None


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return text


def _number(cast: Callable[[str], float], low: float, *, strict: bool = False, high: float | None = None):
    """A ``cast`` value >= low (> low when ``strict``), <= high when given."""

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if cast is int else ' number'}") from None
        if (value <= low if strict else value < low) or (high is not None and value > high):
            bound = f"{'>' if strict else '>='} {low}" + (f" and <= {high}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = cast.__name__
    return parse


positive_int = _number(int, 1)
non_negative_int = _number(int, 0)
positive_float = _number(float, 0, strict=True)
non_negative_float = _number(float, 0)
top_p = _number(float, 0, strict=True, high=1.0)


def controller_address(explicit: str | None, env: str | None, run: str | None) -> str:
    """The controller to talk to: ``--controller``, else RELAYRL_CONTROLLER, else ``<run>/controller.address``
    (``--run runs/NAME``, written by ``relayrl up``). ValueError naming where a bad one came from, or saying how
    to give one when there is none."""
    if explicit:
        return explicit  # parsed by argparse already
    if env:
        return str(_parsed(env, "RELAYRL_CONTROLLER"))
    if run is not None:
        try:
            return str(recorded_address(run, "--run"))
        except AddressError as err:
            raise ValueError(str(err)) from None
    raise ValueError(
        "--controller: no controller address: give --controller HOST:PORT, set RELAYRL_CONTROLLER, "
        "or --run runs/NAME (a run `relayrl up` started)"
    )


def _parsed(text: str, field: str) -> Address:
    try:
        return parse_address(text, field)
    except AddressError as err:
        raise ValueError(str(err)) from None
