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


def write_digits_jsonl(path: str | Path, count: int = 2000, *, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in digits_rows(count, seed=seed)))
    tmp.replace(path)
    return path
