"""The start-up checks before the tokenizer's import nothing heavy (relayrl/ops/preflight.py): ``relayrl up`` starts
its fork server only after them, so every second they spend is a second before any role starts."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "datasets")


def test_every_check_but_the_tokenizers_runs_without_torch_transformers_or_datasets(make_config) -> None:
    config = make_config("cheap")
    code = (
        "import json, sys\n"
        "from relayrl.config import load_config\n"
        "from relayrl.ops.preflight import preflight\n"
        f"preflight(load_config({str(config)!r}), load_tokenizer=False)\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
