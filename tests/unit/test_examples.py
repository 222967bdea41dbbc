"""Every shipped example config parses with ``load_config``, and the GPU example says what it promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.config import load_config
from relayrl.ops.placement import place

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert {"digits.yaml", "gsm8k-qwen2.5.yaml"} <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_config_loads(path: Path) -> None:
    load_config(path)


def test_gsm8k_example_is_a_dapo_run_on_vllm() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "gsm8k-qwen2.5.yaml")
    assert (cfg.data.path, cfg.data.subset) == ("openai/gsm8k", "main")
    # bf16 compute over float32 master weights (lr 1e-6 would not move bf16 parameters updated in place)
    assert (cfg.trainer.precision, cfg.rollout.weight_dtype) == ("bfloat16", "bfloat16")
    assert cfg.rollout.engine == "vllm" and {"tensor_parallel_size", "gpu_memory_utilization"} <= set(
        cfg.rollout.engine_options
    )
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high, cfg.algorithm.loss_agg) == (0.2, 0.28, "token-mean")
    assert cfg.controller.dynamic_sampling and cfg.controller.reward.fn == "math"
    assert cfg.controller.reward.overlong_buffer > 0 and cfg.rollout.max_tokens == 1024 and cfg.rollout.n >= 8
    assert (cfg.weight_sync.backend, cfg.weight_sync.bucket_mib, cfg.weight_sync.mode) == ("nccl", 512, "pause")
    assert cfg.trainer.nproc >= 4
    # `relayrl up` places it on one 8-GPU node by itself
    placed = place(cfg, [str(i) for i in range(8)])
    assert placed == {"rollout-0": "0", "rollout-1": "1", "rollout-2": "2", "rollout-3": "3", "trainer": "4,5,6,7"}


def test_a_hub_dataset_subset_reaches_load_dataset(monkeypatch) -> None:
    from relayrl.config import DataConfig
    from relayrl.data import dataset

    calls = []
    monkeypatch.setattr(dataset.datasets, "load_dataset", lambda *args, **kw: calls.append((args, kw)))
    dataset.load_rows(DataConfig(path="openai/gsm8k", subset="main", split="test"))
    dataset.load_rows(DataConfig(path="some/dataset"))
    assert calls == [(("openai/gsm8k", "main"), {"split": "test"}), (("some/dataset", None), {"split": "train"})]


def test_the_reasoning_gym_example_holds_out_its_own_task_from_a_seed_past_its_rows() -> None:
    """examples/reasoning-gym-smollm2.yaml: the held-out set is the training's task at the same difficulty from a
    seed at least the training's size away, scored by the response's last number."""
    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "reasoning-gym-smollm2.yaml")
    heldout = cfg.eval.sets["heldout"]
    train, held = cfg.data.reasoning_gym, heldout.reasoning_gym
    assert cfg.data.path.startswith("reasoning-gym:") and heldout.path == cfg.data.path
    assert held.config == train.config and held.system_prompt == train.system_prompt
    assert held.seed - train.seed >= train.size
    assert cfg.controller.reward.fn == "last_number" and cfg.model.path == "builtin:smollm2-135m-instruct"
