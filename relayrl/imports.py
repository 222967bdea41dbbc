"""``module:attribute`` specs (reward functions, environments) imported as the roles import them, every failure
one line: the working directory is searched as ``python -m`` searches it, and a module that is not found, does
not compile or raises while it imports is named with the reason (its file and line for a syntax error)."""

from __future__ import annotations

import importlib
import os
import sys


class SpecImportError(ValueError):
    """``spec`` cannot be imported; the message is one line naming it."""


def where_modules_come_from() -> str:
    """What a 'no module named' error should say: the places searched."""
    path = os.environ.get("PYTHONPATH")
    return f"PYTHONPATH ({path})" if path else "PYTHONPATH (unset)"


def import_attr(spec: str, what: str) -> object:
    """The attribute named by ``module:attribute``, the working directory on ``sys.path`` as in the roles;
    SpecImportError ("<what> 'spec' cannot be imported: <reason>") otherwise, ``what`` saying what it is."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module_name, _, attr = spec.partition(":")
    prefix = f"{what} {spec!r} cannot be imported"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        searched = f"{where_modules_come_from()} and the working directory ({os.getcwd()})"
        raise SpecImportError(f"{prefix}: no module named {err.name!r} on {searched}") from None
    except SyntaxError as err:
        raise SpecImportError(f"{prefix}: {err.filename}:{err.lineno}: SyntaxError: {err.msg}") from None
    except Exception as err:  # the module's own code raised while importing
        first = (str(err).strip().splitlines() or [""])[0]
        raise SpecImportError(f"{prefix}: importing {module_name} raised {type(err).__name__}: {first}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SpecImportError(f"{prefix}: {module_name} has no attribute {attr!r}") from None
