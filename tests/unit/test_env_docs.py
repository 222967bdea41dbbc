"""docs/environments.md's Python example runs as written and prints what its comments say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from relayrl.env import EnvironmentClient

ROOT = Path(__file__).resolve().parents[2]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "environments.md").read_text(), re.S)


def test_the_documented_environment_runs(tmp_path) -> None:
    environment, usage = python_blocks()[:2]
    (tmp_path / "spell.py").write_text(environment)
    (tmp_path / "usage.py").write_text(usage)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    result = subprocess.run(
        [sys.executable, "usage.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    expected = [m.strip() for m in re.findall(r"# (.*)$", usage, re.M) if m.startswith(("[", "True"))]
    assert result.stdout.splitlines() == expected


def test_the_relayrl_script_serves_it_from_the_working_directory(tmp_path) -> None:
    """`relayrl env serve spell:SpellBackwards` where spell.py is, as the docs say (the console script does not put
    the working directory on sys.path by itself)."""
    (tmp_path / "spell.py").write_text(python_blocks()[0])
    script = Path(sys.executable).parent / "relayrl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [str(script), "env", "serve", "spell:SpellBackwards"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        line = server.stdout.readline().strip()
        assert line.startswith("environment spell-backwards listening on 127.0.0.1:"), line
        client = EnvironmentClient(line.rpartition(" ")[2], timeout_s=10)
        client.reset("e", {"word": "abc"}, 0)
        assert client.step("e", {"role": "assistant", "content": "cba"}).reward == 1.0
    finally:
        server.terminate()
        server.wait(timeout=30)
