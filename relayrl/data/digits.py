"""The synthetic `digits` task of the CPU demo: "d + 1 =" -> str((d + 1) % 10).

Small enough that a 2-layer model learns it by RL from random initialisation on a CPU in minutes,
verifiable exactly, and hard enough that a random policy scores about 1/vocab.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path


def digits_rows(count: int, *, seed: int = 0, offsets: tuple[int, ...] = (1,)) -> list[dict[str, str]]:
    """``count`` rows {"prompt": "d + k =", "answer": str((d + k) % 10)} with d uniform in 0..9."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        digit, offset = rng.randrange(10), rng.choice(offsets)
        rows.append({"prompt": f"{digit} + {offset} =", "answer": str((digit + offset) % 10)})
    return rows


def heldout_rows() -> list[dict[str, str]]:
    """``builtin:digits-heldout``: the ten prompts "d + 1 =" once each, d = 0..9 (the demo's held-out eval set)."""
    return [{"prompt": f"{digit} + 1 =", "answer": str((digit + 1) % 10)} for digit in range(10)]


def write_digits_jsonl(path: str | Path, count: int = 2000, *, seed: int = 0) -> Path:
    return _write(Path(path), digits_rows(count, seed=seed))


def write_builtin(name: str, path: Path, *, seed: int) -> Path:
    """The built-in data set ``builtin:<name>`` (digits, digits-heldout) written to ``path``."""
    return _write(path, heldout_rows()) if name == "digits-heldout" else write_digits_jsonl(path, seed=seed)


def _write(path: Path, rows: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)
    return path
