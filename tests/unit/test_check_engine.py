"""``relayrl check-engine`` run for real through the CLI: the hf engine on the tiny model passes every check
(samples differ, log-probs equal an HF forward, a weight update through the publisher, gRPC and a gloo group
is verified and changes the outputs); an engine that is not installed exits 2 saying what to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def check_engine(*args: str, path: Path | None = None) -> subprocess.CompletedProcess:
    """``relayrl check-engine ARGS``; ``path``: a directory searched for modules before the repository's."""
    first = f"{path}{os.pathsep}" if path is not None else ""
    env = {**os.environ, "PYTHONPATH": f"{first}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "check-engine", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )


def test_check_engine_passes_for_the_hf_engine_on_the_tiny_model_and_syncs_an_adapter(tiny_model_dir: Path) -> None:
    """One ``check-engine --lora`` run (the hf engine needs no LoRA options, so it is the engine a plain run
    starts): every base check passes in order, log-probs within 1e-3 of a Hugging Face forward, and then the
    adapter path: synced (its bytes reported), the outputs changed by it, log-probs with it."""
    done = check_engine("--engine", "hf", "--model", str(tiny_model_dir), "--lora", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["engine"] == "hf" and report["device"] == "cpu"
    names = [check["name"] for check in report["checks"]]
    assert names == [
        "samples differ (T=0.7)",
        "samples differ (T=1.0)",
        "samples differ (T=1.3)",
        "log-probs vs HF forward",
        "weight update (gRPC + broadcast)",
        "outputs changed by the update",
        "log-probs after the update",
        *LORA_CHECKS,
    ]
    assert report["max_logprob_diff"] <= report["tolerance"] == 1e-3
    assert report["tokens_per_second"] > 0
    checks = {check["name"]: check for check in report["checks"]}
    assert all(check["ok"] for check in checks.values()), checks
    assert "adapter bytes" in checks["adapter sync (gRPC + broadcast)"]["detail"]


def test_check_engine_lora_fails_an_engine_that_ignores_the_adapter(tiny_model_dir: Path) -> None:
    """An engine that reports the adapter's modules as loaded but serves the base model: the log-prob check fails."""
    from relayrl.check_engine import run_check
    from relayrl.rollout.hf import HFEngine

    class Ignoring(HFEngine):
        def load_adapter(self, name, spec, tensors) -> int:
            return len({key.rsplit(".lora_", 1)[0] for key in tensors})

    report = run_check(Ignoring(str(tiny_model_dir)), str(tiny_model_dir), lora=True)
    failed = {check.name for check in report.checks if not check.ok}
    assert "log-probs with the adapter" in failed and not report.ok


LORA_CHECKS = ("adapter sync (gRPC + broadcast)", "outputs changed by the adapter", "log-probs with the adapter")


def test_check_engine_without_vllm_exits_2_with_the_install_command(tiny_model_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "vllm"  # vLLM absent whether or not this machine has it: its import fails as a missing one
    missing.mkdir()
    (missing / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n")
    done = check_engine("--engine", "vllm", "--model", str(tiny_model_dir), path=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pip install 'relayrl[vllm]' (that is vllm>=0.33.0,<0.34)" in done.stderr
