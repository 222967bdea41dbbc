"""A whole ``relayrl up`` run under mTLS + token: every internal client authenticates (rollout heartbeat ->
controller, controller -> workers, trainer -> controller and workers), and the token appears nowhere in
the run's logs, config dumps, metrics, state or console output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .helpers import TOKEN_ENV

pytestmark = pytest.mark.slow


def test_secure_run_trains_and_never_leaks_the_token(make_config, pki, token, tmp_path) -> None:
    security = {
        "auth_token_env": TOKEN_ENV,
        "tls_cert": str(pki.cert),
        "tls_key": str(pki.key),
        "tls_ca": str(pki.ca),
        "require_client_cert": True,
    }
    config = make_config("secure", security=security, trainer={"steps": 2})
    result = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "up", str(config)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
        env={**os.environ, TOKEN_ENV: token},
    )
    run_dir = Path(yaml.safe_load(config.read_text())["run"]["dir"]) / "secure"
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.log")))
    assert result.returncode == 0, result.stderr[-3000:] + logs[-5000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    assert "UNAUTHENTICATED" not in logs and "no valid bearer token" not in logs

    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"config.yaml", "metrics.jsonl", "summary.json"} <= {p.name for p in files}
    leaks = [str(p) for p in files if token.encode() in p.read_bytes()]
    assert not leaks, f"the token is in {leaks}"
    assert token not in result.stdout + result.stderr
    dumped = (run_dir / "config.yaml").read_text()
    assert TOKEN_ENV in dumped and str(pki.key) in dumped  # names and paths only, never secrets
