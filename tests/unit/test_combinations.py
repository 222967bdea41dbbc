"""Features meet each other (issue 44, item 5): every advantage estimator (the registry of
relayrl/algorithms/advantages.py, gae included) and every policy loss, with each feature — the samples log, eval,
streaming, K = 1 with the engine's old logprobs, LoRA, Megatron, the critic — either trains 2 steps on a tiny model
or is refused at load by the config layer (what `relayrl check` and `relayrl up` run first) with a message naming
the feature's key and the algorithm's; and so does every pair of those features.

The 2 steps run in this one process (a one-rank gloo world) through the trainer's own pieces: ``run_backend`` for the
config, ``train_whole`` or ``train_streamed`` (a streamed config's parts relayed as rank 0 does), and the samples
log's ``step_samples`` with the advantages the step reported. Eval adds nothing to a trainer step (the workers score
held-out sets): its cells check that the config loads and trains; the whole eval path with gae and the samples log
runs under `relayrl up` in tests/integration/test_combinations_cli.py, beside `relayrl check` refusing these
combinations as `relayrl up` does.
"""

from __future__ import annotations

import itertools
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from trainer_testing import batch_message, stream_source
from transformers import AutoTokenizer

from relayrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from relayrl.algorithms.policy_loss import POLICY_LOSSES
from relayrl.config import GROUP_LOCAL_ADVANTAGES, TRAINER_ANCHORED_LOSSES, ConfigError, RelayConfig, parse_config
from relayrl.runtime.ports import free_port
from relayrl.trainer.loop import run_backend, train_streamed, train_whole
from relayrl.trainer.samples import step_samples

N, GROUPS, PAD = 4, 4, 0
# distill reads a served teacher's log-probs (a scorer process): tests/integration/test_scorer_up.py trains it
ADVANTAGES = [name for name in ADVANTAGE_ESTIMATORS.names() if name != "distill"]
LOSSES = POLICY_LOSSES.names()
# feature -> (the config sections it sets, the key a refusal of it names); Megatron last: it sets up model parallelism
# (the critic is gae's: a refusal of a pair with it may name algorithm.advantage instead)
FEATURES = {
    "samples log": ({"samples": {"every": 1, "prompts": 2}}, "samples"),
    "eval": ({"eval": {"sets": {"heldout": {"path": "heldout.jsonl"}}, "every": 1}}, "eval"),
    "streaming": ({"trainer": {"stream": "on"}}, "trainer.stream"),
    "K=1 engine old logprobs": (
        {"controller": {"max_staleness": 1}, "algorithm": {"old_logprobs": "rollout"}},
        "algorithm.old_logprobs",
    ),
    "rollout correction": (
        {
            "algorithm": {
                "rollout_correction": {"rollout_is": "token", "rollout_rs": "token_k3", "rollout_rs_threshold": 0.5}
            }
        },
        "algorithm.rollout_correction",
    ),
    "LoRA": ({"model": {"lora": {"rank": 4, "alpha": 8.0}}}, "model.lora"),
    "critic": ({"critic": {"warmup_steps": 1, "lr": 0.01}}, "critic."),
    "Megatron": ({"trainer": {"backend": "megatron"}}, "trainer.backend"),
}


# Pairs of features the config refuses together (with grpo and ppo_clip, the critic's pairs with gae): streaming
# needs K = 0 with the engine's old logprobs, a per-group advantage and FSDP; LoRA and the critic train on FSDP's full
# weights (LoRA: FSDP only; the critic: not beside an adapter); IS weights need a proximal policy not the engine's
REFUSED_PAIRS = {
    ("streaming", "K=1 engine old logprobs"),
    ("K=1 engine old logprobs", "rollout correction"),
    ("streaming", "critic"),
    ("streaming", "Megatron"),
    ("LoRA", "critic"),
    ("LoRA", "Megatron"),
    ("critic", "Megatron"),
}


def refused(feature: str, advantage: str, loss: str) -> bool:
    """The combinations the config refuses, by rule: a streamed step needs a per-group advantage and the engine's
    old logprobs (not gspo, anchored on the trainer's); gspo refuses the engine's; the critic (gae) is built on the
    FSDP backend's full weights; a critic section without gae trains nothing."""
    return {
        "streaming": advantage not in GROUP_LOCAL_ADVANTAGES or loss in TRAINER_ANCHORED_LOSSES,
        "K=1 engine old logprobs": loss in TRAINER_ANCHORED_LOSSES,
        "LoRA": advantage == "gae",
        "Megatron": advantage == "gae",
        "critic": advantage != "gae",
    }.get(feature, False)


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    """A gloo world of this process alone, on one torch thread (a tiny model's matmuls gain nothing from more, and
    on a loaded machine more threads made these steps several times slower)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def merged(base: dict, sections: dict) -> dict:
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for section, keys in sections.items():
        out[section] = {**out.get(section, {}), **keys}
    return out


def combination(model_dir: str, features: str | tuple[str, ...], advantage: str, loss: str) -> dict:
    """The run config of ``features`` (one or more) with ``advantage`` and ``loss`` on a tiny model."""
    out = {
        "model": {"path": model_dir},
        "data": {"path": "train.jsonl"},
        "rollout": {"n": N, "max_tokens": 8},
        "controller": {"train_batch_groups": GROUPS},
        "trainer": {"steps": 2, "lr": 0.01, "mini_batches": 2, "precision": "float32"},
        "algorithm": {"advantage": advantage, "policy_loss": loss},
    }
    for feature in (features,) if isinstance(features, str) else features:
        out = merged(out, FEATURES[feature][0])
    return out


def train_two_steps(cfg: RelayConfig, tokenizer) -> list[dict]:
    """Steps 1 and 2 on batches of GROUPS groups whose rollout logprobs are the backend's own at the version that
    generated them: version s - 1 at step s, or version 0 for both under K = 1 (step 2's is stale by one). Returns
    each step's metrics, with its per-sample advantages and samples-log records."""
    backend = run_backend(cfg)
    verified = frozenset({"w0"})
    batches = {1: batch_message(backend, GROUPS, seed=1, n=N, target=GROUPS)}
    if cfg.controller.max_staleness:
        batches[2] = batch_message(backend, GROUPS, seed=2, n=N, target=GROUPS)
    steps = []
    for step in (1, 2):
        batch = batches.get(step) or batch_message(backend, GROUPS, seed=step, n=N, target=GROUPS, version=step - 1)
        advantages: list[torch.Tensor] = []
        if cfg.streams:
            parts = stream_source(batch, [1] * GROUPS, 0)
            trained, metrics = train_streamed(backend, cfg, step, parts, verified, PAD, on_advantages=advantages.append)
            assert metrics["streamed"] == 1.0 and list(trained.samples) == list(batch.samples)
        else:
            metrics = train_whole(backend, cfg, step, batch, PAD, verified, advantages.append)
        (sample_advantages,) = advantages
        records = step_samples(batch, step, tokenizer, sample_advantages.tolist(), cfg.samples) if cfg.samples else []
        steps.append({"metrics": metrics, "advantages": sample_advantages, "records": records, "batch": batch})
    return steps


def check_trained(cfg: RelayConfig, steps: list[dict]) -> None:
    for step in steps:
        assert all(math.isfinite(v) for v in step["metrics"].values()), step["metrics"]
        assert len(step["advantages"]) == len(step["batch"].samples) and bool(torch.isfinite(step["advantages"]).all())
    second = steps[1]["metrics"]
    assert second["grad_norm"] > 0  # the policy trained
    if cfg.algorithm.advantage == "gae":
        assert steps[0]["metrics"]["policy_frozen"] == float(cfg.critic.warmup_steps >= 1)
        assert second["policy_frozen"] == 0.0 and second["critic_grad_norm"] > 0
    if cfg.controller.max_staleness:  # the stale batch's old logprobs are the engine's (no forward)
        assert second["old_logprobs_from_engine"] == 1.0
    if cfg.samples is not None:  # the records carry the step's own advantages, sample by sample
        for step in steps:
            logged = [s["advantage"] for record in step["records"] for s in record["samples"]]
            assert len(step["records"]) == cfg.samples.prompts
            assert logged == step["advantages"][: len(logged)].tolist()


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_trains_two_steps_with_every_algorithm_or_refuses_it_naming_both_keys(
    tiny_model_dir, feature
) -> None:
    """Every advantage x policy loss with ``feature``: refused exactly where ``refused`` says, naming the feature's
    key and the algorithm's; otherwise 2 steps train."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    feature_key = FEATURES[feature][1]
    began, trained = time.perf_counter(), 0
    for advantage in ADVANTAGES:
        for loss in LOSSES:
            cell = (feature, advantage, loss)
            try:
                cfg = parse_config(combination(str(tiny_model_dir), *cell))
            except ConfigError as err:
                message = str(err)
                assert refused(*cell), (cell, message)
                assert feature_key in message, (cell, message)
                assert "algorithm.advantage" in message or "algorithm.policy_loss" in message, (cell, message)
                continue
            assert not refused(*cell), f"{cell} loads, but the config should refuse it"
            torch.manual_seed(0)
            check_trained(cfg, train_two_steps(cfg, tokenizer))
            trained += 1
    assert trained, f"{feature} trains with no algorithm"
    print(f"{feature}: {trained} combinations trained 2 steps in {time.perf_counter() - began:.1f} s")


def test_each_pair_of_features_trains_two_steps_or_is_refused_naming_both(tiny_model_dir) -> None:
    """Features meet each other too: every pair, with grpo and ppo_clip (gae for the critic's), trains 2 steps or is
    refused (exactly REFUSED_PAIRS) naming a key of each."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for pair in itertools.combinations(FEATURES, 2):
        advantage = "gae" if "critic" in pair else "grpo"
        try:
            cfg = parse_config(combination(str(tiny_model_dir), pair, advantage, "ppo_clip"))
        except ConfigError as err:
            message = str(err)
            assert pair in REFUSED_PAIRS, (pair, message)
            for feature in pair:
                keys = (FEATURES[feature][1], "algorithm.advantage") if feature == "critic" else (FEATURES[feature][1],)
                assert any(key in message for key in keys), (pair, feature, message)
            continue
        assert pair not in REFUSED_PAIRS, f"{pair} loads, but the config should refuse it"
        torch.manual_seed(0)
        check_trained(cfg, train_two_steps(cfg, tokenizer))
