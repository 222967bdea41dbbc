"""docs/environments.md's Python example runs as written and prints what its comments say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_environment_runs(tmp_path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "environments.md").read_text(), re.S)
    environment, usage = blocks[0], blocks[1]
    (tmp_path / "spell.py").write_text(environment)
    (tmp_path / "usage.py").write_text(usage)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    result = subprocess.run(
        [sys.executable, "usage.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    expected = [m.strip() for m in re.findall(r"# (.*)$", usage, re.M) if m.startswith(("[", "True"))]
    assert result.stdout.splitlines() == expected
