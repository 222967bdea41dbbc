"""The model-family table, generated from ``relayrl/models/families.py`` at build time.

A page that contains the line ``<!-- model-families -->`` gets, in its place, one table: a row per family of
``FAMILIES`` (its tiny test model's title), a column per fast path of ``PATHS``, each cell the path's claim on the
family (``claim``): exact, falls back or refused, with the reason the log line or the refusal gives. The claims are
the ones tests/unit/test_families.py checks, so the table says what the tests prove.
"""

from __future__ import annotations

import sys
from pathlib import Path

MARKER = "<!-- model-families -->"
ROOT = Path(__file__).resolve().parents[2]


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs hook
    if MARKER not in markdown:
        return markdown
    sys.path.insert(0, str(ROOT))  # document this tree's relayrl, whichever one the venv installed
    return markdown.replace(MARKER, render())


def render() -> str:
    """The table (module docstring) as markdown."""
    from relayrl.models.families import FAMILIES, PATHS, claim

    lines = ["| family (`relayrl/models/families.py`) | " + " | ".join(f"`{p}`" for p in PATHS) + " |"]
    lines.append("|---" * (len(PATHS) + 1) + "|")
    for name, family in FAMILIES.items():
        cells = []
        for path in PATHS:
            found = claim(name, path)
            cells.append(found.status if found.status == "exact" else f"**{found.status}**: {found.reason}")
        lines.append(f"| {family.title} (`{name}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines)
