"""Fault points: the places where a test may make a role die on purpose. Off unless a test arms one.

A fault point is a named place in the product where a crash shows whether the rest of the system copes: a rollout
worker dying in the middle of a weight load, the controller dying in the middle of a ledger write. Nothing happens
at a point unless the role's environment arms it:

- ``RELAYRL_FAULT=<point>@<key>`` arms one point for one key (below); the role exits with code 137 there, as a
  SIGKILL would end it (``os._exit``: no cleanup, Python's buffers not flushed), after one stderr line naming it.
- ``RELAYRL_FAULT_ONCE=<path>`` (optional) fires only if ``path`` can be created, so a role its supervisor restarts
  with the same environment does not die again at the same point.

Points (``point``: its key; where it fires):

- ``rollout.load``: ``<worker id>/<version>``; once the worker received the first chunk of that version.
- ``ledger.write``: ``<state>/<step>``; in the controller ledger's write of the events of that state and step, after
  about half of its bytes (the middle of the line holding the middle byte): a torn last line.

This module is the only place the product reads these variables (tests/unit/test_faults.py checks it).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

ARM = "RELAYRL_FAULT"
ONCE = "RELAYRL_FAULT_ONCE"
POINTS = ("rollout.load", "ledger.write")
EXIT_CODE = 137  # what a shell reports for a SIGKILLed process


def armed(point: str, key: str) -> bool:
    """Whether ``point`` is armed for ``key`` (and, with ``RELAYRL_FAULT_ONCE``, has not fired yet: the first call
    that answers True marks it fired)."""
    if point not in POINTS:
        raise ValueError(f"fault point {point!r} is not one of {POINTS}")
    if os.environ.get(ARM) != f"{point}@{key}":
        return False
    once = os.environ.get(ONCE)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
    return True


def crash(point: str) -> NoReturn:
    """End the process at ``point`` with EXIT_CODE, as a SIGKILL would (no cleanup)."""
    sys.stderr.write(f"fault point {point}: exiting with code {EXIT_CODE} ({ARM} armed it)\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)
