"""The fairness record every bench JSON carries as ``machine`` (``machine_record``): what the machine was, what code
ran, and what each side actually computed with, so that two figures are compared only where these agree.

- ``cpu_model`` and ``cpu_flags`` (/proc/cpuinfo: the flags decide, e.g., whether bf16 is native: AMX-BF16,
  AVX512-BF16), ``cpus`` and ``cpus_usable`` (the affinity), the load average at the start, platform, Python and
  the packages' versions;
- ``git``: the commit of the relayrl checkout that ran and whether its tree was ``dirty`` (tracked files changed,
  ``bench/results/`` aside: a result written with ``> bench/results/x.json`` changes a tracked file before the bench
  starts), with the changed paths; ``{"commit": null}`` outside a git checkout (an installed package);
- ``resolved``: per side (a mode, a system, a run), the ``precision`` it computed in and its
  ``attn_implementation``, as resolved (``trainer.precision: auto`` and ``model.attn_implementation: auto`` name
  a choice the machine and the model make): read from the model a side loaded (``model_side``) or from the lines a
  run's roles log (``run_sides``); null where the bench computes no model (the controller, weight sync).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

from relayrl.runtime.attention import resolved
from relayrl.runtime.precision import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("relayrl", "torch", "transformers", "trl", "accelerate")
RESULTS = "bench/results"  # written by the bench itself: never what makes a tree dirty
# what the roles log as they load (relayrl/trainer/precision.py, relayrl/trainer/backends/fsdp.py,
# relayrl/rollout/hf.py)
TRAINER_PRECISION = re.compile(r"trainer\.precision=\S+: (\S+) compute \(([^)]*)\)")
TRAINER_ATTENTION = re.compile(r"trainer model: (\S+) attention")
ENGINE_LOAD = re.compile(r"hf engine: (\S+) attention \(model\.attn_implementation=\S+\), (\S+) weights")
TRL_LOAD = re.compile(r"trl model: (\S+) attention, (\S+) compute")  # relayrl/bench/trl_runner.py


def machine_record(resolved_sides: dict[str, dict] | None) -> dict:
    """The record (module docstring); ``resolved_sides``: side -> {"precision", "attn_implementation"}, None where
    no model computes."""
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": " ".join(sorted(cpu_flags())),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "loadavg_at_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {package: _version(package) for package in PACKAGES},
        "git": git_state(),
        "resolved": resolved_sides,
    }


def cpu_model() -> str | None:
    """/proc/cpuinfo's first ``model name``, else platform's processor (None when neither says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or None


def git_state(root: Path = ROOT) -> dict:
    """``{"commit", "dirty", "dirty_paths"}`` of the checkout at ``root`` (module docstring)."""
    try:
        commit = _git(root, "rev-parse", "HEAD").strip()
        changed = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS}")
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "dirty_paths": []}
    paths = [line[3:] for line in changed.splitlines() if line.strip()]
    return {"commit": commit, "dirty": bool(paths), "dirty_paths": paths}


def model_side(model, compute) -> dict:
    """A side that computed with ``model`` in ``compute`` (a torch dtype)."""
    return {"precision": str(compute).removeprefix("torch."), "attn_implementation": resolved(model)}


def run_sides(logs: Path) -> dict[str, dict]:
    """The sides of the roles whose logs are in ``logs``: the trainer (``trainer.log``) and each engine
    (``rollout*.log``), as each logged what it resolved (a value no line states is null)."""
    sides = {"trainer": trainer_side(logs / "trainer.log")} if (logs / "trainer.log").is_file() else {}
    return sides | {log.stem: engine_side(log) for log in sorted(logs.glob("rollout*.log"))}


def trainer_side(log: Path) -> dict:
    """A trainer's precision (with why: "auto: CPU avx512_bf16") and attention, from its log."""
    text = _read(log)
    precision, attention = TRAINER_PRECISION.search(text), TRAINER_ATTENTION.search(text)
    return {
        "precision": f"{precision[1]} ({precision[2]})" if precision else None,
        "attn_implementation": attention[1] if attention else None,
    }


def engine_side(log: Path) -> dict:
    """An hf engine's weight dtype and attention, from its log."""
    found = ENGINE_LOAD.search(_read(log))
    return {"precision": found[2] if found else None, "attn_implementation": found[1] if found else None}


def trl_side(log: Path) -> dict:
    """A TRL run's compute dtype and attention, from its log (relayrl/bench/trl_runner.py's line)."""
    found = TRL_LOAD.search(_read(log))
    return {"precision": found[2] if found else None, "attn_implementation": found[1] if found else None}


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
    ).stdout


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
