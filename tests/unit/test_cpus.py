"""Role CPU pinning (``rollout.cpus``, ``trainer.cpus``): the CPU-list format, the pin itself (every thread of a
process, in a fresh one), its refusal of CPUs the process may not use, and the thread rule for pinned roles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import ConfigError, RelayConfig
from relayrl.cores.threads import check_role_cpus, shares_cores, torch_threads, trainer_env
from relayrl.runtime.cpus import format_cpu_list, parse_cpu_list

DEMO = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"

# A fresh process with a thread already running pins itself with trainer.cpus = the CPU given, then reports the
# affinity of the thread started before the pin, of one started after it, and of the main thread.
PROBE = """
import json, os, sys, threading
from relayrl.config import RelayConfig
from relayrl.cores.threads import pin_role
go, seen = threading.Event(), {}
early = threading.Thread(target=lambda: (go.wait(), seen.update(early=sorted(os.sched_getaffinity(0)))), daemon=True)
early.start()
cfg = RelayConfig.model_validate({"model": {"path": "m"}, "data": {"path": "d"}, "trainer": {"cpus": sys.argv[1]}})
pin_role(cfg, "trainer")
go.set(); early.join()
late = threading.Thread(target=lambda: seen.update(late=sorted(os.sched_getaffinity(0))))
late.start(); late.join()
print(json.dumps({**seen, "main": sorted(os.sched_getaffinity(0))}))
"""


def config(**sections) -> RelayConfig:
    return RelayConfig.model_validate({"model": {"path": "m"}, "data": {"path": "d"}, **sections})


@pytest.mark.parametrize(
    ("text", "cpus", "canonical"),
    [("0", (0,), "0"), ("0-3,8", (0, 1, 2, 3, 8), "0-3,8"), ("5,1-2,2", (1, 2, 5), "1-2,5")],
)
def test_cpu_lists_read_and_write_the_kernel_format(text, cpus, canonical) -> None:
    assert parse_cpu_list(text) == cpus
    assert format_cpu_list(cpus) == canonical


def test_a_role_pins_every_thread_of_its_process() -> None:
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", PROBE, str(cpu)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"early": [cpu], "late": [cpu], "main": [cpu]}


def test_cpus_this_process_may_not_use_are_refused_naming_the_key() -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=rf"^rollout\.cpus: CPU {missing} is not available here"):
        check_role_cpus(config(rollout={"cpus": str(missing)}))
    out = subprocess.run([sys.executable, "-c", PROBE, str(missing)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and f"trainer.cpus: CPU {missing} is not available here" in out.stderr


def test_pinned_roles_count_their_own_cpus(monkeypatch) -> None:
    """Disjoint CPUs: each role takes all of its own, K = 1 included (no halving beside the trainer), and the
    trainer neither waits passively nor yields; overlapping CPUs keep the shared-core rule."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    split = config(
        rollout={"workers": 2, "cpus": "4-7"}, trainer={"nproc": 2, "cpus": "0-3"}, controller={"max_staleness": 1}
    )
    assert not shares_cores(split)
    assert torch_threads(split, "rollout", colocated=True) == 2  # 4 CPUs, 2 workers
    assert torch_threads(split, "trainer", colocated=True) == 2  # 4 CPUs, 2 ranks
    assert trainer_env(split) == {"OMP_NUM_THREADS": "2"}
    overlapping = config(
        rollout={"workers": 1, "cpus": "0-3"}, trainer={"cpus": "2-5"}, controller={"max_staleness": 1}
    )
    assert shares_cores(overlapping)
    assert torch_threads(overlapping, "rollout", colocated=True) == 2  # half of its 4, beside the trainer
    assert trainer_env(overlapping)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert shares_cores(config(rollout={"cpus": "0"}))  # the trainer may run anywhere, its CPU 0 too


def test_relayrl_up_refuses_a_missing_cpu_before_it_starts_anything(tmp_path) -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    sets = [
        f"trainer.cpus={min(os.sched_getaffinity(0))},{missing}",
        f"run.dir={tmp_path / 'runs'}",
    ]
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(DEMO), *[arg for s in sets for arg in ("--set", s)]]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)  # nothing built: the refusal comes first
    assert out.returncode == 2
    assert f"trainer.cpus: CPU {missing} is not available here" in out.stderr
    assert not any(tmp_path.iterdir())
