"""Shared fixtures: a tiny Qwen2 model and the digits dataset built once per session, and run configs."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

TESTS = Path(__file__).resolve().parent
# tests/<directory>/... carries the marker of its directory, so one slice runs alone: `pytest -m unit`
# (registered in pyproject.toml; docs/development.md lists them)
SLICES = {"unit", "integration", "e2e", "security", "fuzz", "deploy", "slurm", "docs"}


HEAVY = "heavy"  # minutes on a 2-core machine: out of the default run (make test); `pytest -m heavy` runs them


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{HEAVY}: too slow for make test; run with -m {HEAVY} (cost: bench/results)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.resolve().relative_to(TESTS).parts
        if len(parts) > 1 and parts[0] in SLICES:
            item.add_marker(parts[0])
    if HEAVY not in (config.getoption("markexpr") or ""):  # selected by name only through -m
        heavy = [item for item in items if item.get_closest_marker(HEAVY)]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if not item.get_closest_marker(HEAVY)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from relayrl.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2", seed=0, hidden_size=32, layers=2)


@pytest.fixture(scope="session")
def digits_path(tmp_path_factory) -> Path:
    from relayrl.data.digits import write_digits_jsonl

    return write_digits_jsonl(tmp_path_factory.mktemp("data") / "digits.jsonl", count=500)


def deep_merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.fixture
def make_config(tmp_path, tiny_model_dir, digits_path):
    """write a small run config (digits.yaml's shape) with section overrides; returns its path."""

    def _make(name: str = "run", **sections) -> Path:
        base = {
            "run": {"name": name, "dir": str(tmp_path / "runs"), "seed": 0},
            "model": {"path": str(tiny_model_dir)},
            "data": {"path": str(digits_path)},
            "rollout": {"workers": 2, "n": 4, "max_tokens": 4},
            "controller": {
                "prompts_per_gen_batch": 4,
                "train_batch_groups": 4,
                "max_gen_batches": 50,
                "reward": {"fn": "prefix_match"},
            },
            # one rank: a test of ranks says 2. float32 compute: the tests hold engine and trainer to float rounding
            # (bf16 compute: tests/unit/test_precision.py, and the demo's default in tests/e2e/test_demo.py)
            "trainer": {"steps": 3, "nproc": 1, "lr": 0.003, "mini_batches": 2, "precision": "float32"},
            "weight_sync": {"bucket_mib": 1, "timeout_s": 30},
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(deep_merge(base, sections)))
        return path

    return _make
