"""``relayrl bench e2e``'s arithmetic: steady rates, time to target, medians and ratios, the TRL mirror, CPU."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from relayrl.bench.cpu import CpuSampler, cpu_seconds, tree_cpu_by_role
from relayrl.bench.e2e import (
    CRITIC_PAIRS,
    DEMO_CONFIG,
    UNMEASURED,
    WORKLOADS,
    Run,
    aggregate,
    check_mirrorable,
    reach_target,
    select_variants,
    split_cpus,
    summarize,
    trl_spec,
    workload,
)
from relayrl.config import load_config


def records(rewards: list[float], *, samples: int = 4, length: float = 8.0, step_s: float = 2.0) -> list[dict]:
    timing = {"response_len_mean": length, "generation_seconds": 0.5, "train_seconds": 1.0}
    return [
        {"step": i + 1, "time": 100.0 + step_s * (i + 1), "reward_mean": r, "samples_generated": samples, **timing}
        for i, r in enumerate(rewards)
    ]


def a_run(recs: list[dict], system: str = "trl") -> Run:
    return Run("w", system, 1, launched=90.0, wall_s=60.0, returncode=0, records=recs, log=Path("log"))


ARGS = argparse.Namespace(warmup=2, target=0.9, target_window=3)


def test_target_is_the_first_full_window_whose_mean_reaches_it() -> None:
    run = a_run(records([0.0, 1.0, 1.0, 1.0, 0.5, 1.0]))  # trailing-3 means: -, -, .67, 1.0, .83, .83
    hit = reach_target(run, 0.9, 3)
    assert hit["reached"] and hit["step"] == 4 and hit["samples"] == 16
    assert hit["wall_s"] == pytest.approx(100.0 + 8.0 - 90.0)  # the step's end time, from launch
    miss = reach_target(run, 1.01, 3)
    assert not miss["reached"] and miss["wall_s"] is None and miss["best_mean"] == pytest.approx(1.0)
    short = reach_target(a_run(records([1.0, 1.0])), 0.9, 3)  # fewer steps than the window never count as reached
    assert not short["reached"] and short["best_mean"] == pytest.approx(1.0)


def test_summary_rates_cover_the_steady_steps_only() -> None:
    row = summarize(a_run(records([0.0] * 6, samples=16, length=8.0)), ARGS, max_tokens=8, expect_equal_work=True)
    assert row["steady_steps"] == 4 and row["s_per_step"] == pytest.approx(2.0)
    assert row["samples_per_s"] == pytest.approx(8.0) and row["tokens_per_s"] == pytest.approx(64.0)
    assert row["generation_s"] == pytest.approx(0.5) and row["train_s"] == pytest.approx(1.0)
    assert row["equal_work_held"] is True
    unequal = records([0.0] * 6, length=8.0)
    unequal[0]["response_len_mean"] = 7.5
    assert summarize(a_run(unequal), ARGS, max_tokens=8, expect_equal_work=True)["equal_work_held"] is False
    failed = summarize(a_run(records([0.0] * 2)), ARGS, max_tokens=8, expect_equal_work=False)
    assert "error" in failed


def test_medians_over_rounds_and_ratios_against_trl() -> None:
    rows = [
        summarize(a_run(records([1.0] * 5, step_s=s), system), ARGS, 8, False)
        for system, s in [("relayrl-k0", 1.0), ("relayrl-k0", 3.0), ("relayrl-k0", 2.0), ("trl", 4.0), ("trl", 4.0)]
    ]
    out = aggregate(rows)
    assert out["systems"]["relayrl-k0"]["s_per_step"] == pytest.approx(2.0)
    assert out["systems"]["relayrl-k0"]["rounds_ok"] == 3 and out["systems"]["trl"]["target_reached_rounds"] == 2
    ratios = out["relayrl_vs_trl"]["relayrl-k0/trl"]
    assert ratios["samples_per_s"] == pytest.approx(2.0) and ratios["step_speedup"] == pytest.approx(2.0)
    assert ratios["wall_to_target_speedup"] > 1.0


def test_ratios_by_round_pair_each_run_with_the_trl_run_of_its_round() -> None:
    rows = [
        summarize(Run("w", system, rnd, 90.0, 60.0, 0, records([0.0] * 5, step_s=s), Path("log")), ARGS, 8, False)
        for system, rnd, s in [("relayrl-k0", 1, 1.0), ("trl", 1, 2.0), ("relayrl-k0", 2, 1.0), ("trl", 2, 3.0),
                               ("relayrl-k0", 3, 1.0)]  # round 3's TRL run is missing: that round has no pair
    ]  # fmt: skip
    ratios = aggregate(rows)["relayrl_vs_trl"]["relayrl-k0/trl"]
    assert ratios["samples_per_s_by_round"] == pytest.approx([2.0, 3.0])
    assert ratios["samples_per_s"] == pytest.approx(4.0 / ((2.0 + 4 / 3) / 2))  # the ratio of medians: 2.4


def test_critic_cost_pairs_ppo_with_grpo_of_the_same_round() -> None:
    """PPO with a critic against GRPO's whole-batch run: medians over rounds of the s/step and train s ratios and of
    the critic's seconds (its forward plus updates, from the records)."""

    def critic_records(step_s: float, train_s: float, critic: tuple[float, float] | None) -> list[dict]:
        recs = records([0.0] * 5, step_s=step_s)
        for r in recs:
            r["train_seconds"] = train_s
            if critic is not None:
                r["critic_values_seconds"], r["critic_update_seconds"] = critic
        return recs

    rows = [
        summarize(Run("w", system, rnd, 90.0, 60.0, 0, critic_records(s, t, c), Path("log")), ARGS, 8, False)
        for system, rnd, s, t, c in [
            ("relayrl-k0-whole", 1, 1.0, 0.5, None), ("relayrl-k0-gae", 1, 1.5, 1.0, (0.1, 0.4)),
            ("relayrl-k0-whole", 2, 2.0, 1.0, None), ("relayrl-k0-gae", 2, 2.0, 1.5, (0.2, 0.2)),
            ("relayrl-k0-gae", 3, 9.0, 9.0, (1.0, 1.0)),  # no GRPO partner in round 3: left out
        ]
    ]  # fmt: skip
    out = aggregate(rows)["critic_vs_grpo"]["relayrl-k0-gae"]
    assert out["vs"] == "relayrl-k0-whole" and out["rounds"] == 2
    assert out["step_ratio"] == pytest.approx((1.5 + 1.0) / 2)
    assert out["train_ratio"] == pytest.approx((2.0 + 1.5) / 2)
    assert out["critic_s_per_step"] == pytest.approx((0.5 + 0.4) / 2)


def test_stream_vs_whole_pairs_each_streamed_run_with_the_whole_batch_run_of_its_round() -> None:
    """Whole-batch s/step over streamed s/step per round (> 1: streaming faster), and the same for the runs' median
    steps; long-tail's whole-batch K = 0 is its default variant; a round without its partner is left out."""

    def timed(step_s: float, medians: float) -> list[dict]:
        recs = records([0.0] * 5, step_s=step_s)
        for r in recs:
            r["step_seconds"] = medians
        recs[-1]["step_seconds"] = 100.0  # a burst of other load on one step: the median keeps out of it
        return recs

    rows = [
        summarize(Run("w", system, rnd, 90.0, 60.0, 0, timed(s, m), Path("log")), ARGS, 8, False)
        for system, rnd, s, m in [
            ("relayrl-default", 1, 2.0, 2.0), ("relayrl-k0-stream", 1, 1.6, 1.0),
            ("relayrl-k0-stream", 2, 2.5, 2.0), ("relayrl-default", 2, 2.0, 1.0), ("relayrl-k0-stream", 3, 1.0, 1.0),
        ]
    ]  # fmt: skip
    out = aggregate(rows)["stream_vs_whole"]["relayrl-k0-stream"]
    assert out["vs"] == "relayrl-default" and out["rounds"] == 2
    assert out["speedup_by_round"] == pytest.approx([1.25, 0.8]) and out["speedup"] == pytest.approx(1.025)
    assert out["median_step_speedup_by_round"] == pytest.approx([2.0, 0.5]) and out["median_step_speedup"] == 1.25


def test_overlap_compares_a_k1_step_with_the_phases_k0_ran_alone() -> None:
    """K = 1 s/step over max(generation, training) of the same round's K = 0 run (1.0 s of training, 0.5 of
    generation in these records); rounds without their K = 0 partner are left out."""
    rows = [
        summarize(Run("w", system, rnd, 90.0, 60.0, 0, records([0.0] * 5, step_s=s), Path("log")), ARGS, 8, False)
        for system, rnd, s in [
            ("relayrl-k0-split", 1, 1.6), ("relayrl-k1-rollout-split", 1, 1.1),
            ("relayrl-k0-split", 2, 1.5), ("relayrl-k1-rollout-split", 2, 1.0), ("relayrl-k1-rollout", 1, 1.3),
        ]
    ]  # fmt: skip
    out = aggregate(rows)["overlap"]
    assert set(out) == {"relayrl-k1-rollout-split"}  # relayrl-k0-whole never ran
    split = out["relayrl-k1-rollout-split"]
    assert split["phases_alone_from"] == "relayrl-k0-split" and split["rounds"] == 2
    assert split["step_vs_phases_alone"] == pytest.approx(1.05)  # median of 1.1 and 1.0
    assert split["speedup_vs_k0"] == pytest.approx((1.6 / 1.1 + 1.5 / 1.0) / 2)


def test_split_variants_give_trainer_and_worker_disjoint_halves() -> None:
    assert split_cpus([0, 1]) == ("0", "1")
    assert split_cpus([0, 1, 2, 3, 5]) == ("0-2", "3,5")
    assert split_cpus([4]) is None


def test_trl_runs_what_the_relayrl_config_says(tmp_path: Path) -> None:
    overrides = ["model.path=m", "data.path=d.jsonl", "rollout.ignore_eos=true", "rollout.max_tokens=48"]
    overrides += ["trainer.lr=0.0025"]  # neither the demo's nor a default: the spec must take it from the config
    cfg = load_config(DEMO_CONFIG, overrides)
    spec = trl_spec(cfg, steps=5, threads=2, run_dir=tmp_path)
    assert spec["equal_work"] and spec["max_tokens"] == 48 and spec["n"] == cfg.rollout.n
    assert spec["prompts_per_step"] == cfg.controller.train_batch_groups and spec["mini_batches"] == 2
    assert (spec["clip_low"], spec["clip_high"], spec["lr"]) == (0.2, 0.28, 0.0025)
    with pytest.raises(SystemExit, match=r"algorithm\.kl_coef"):
        check_mirrorable(load_config(DEMO_CONFIG, [*overrides, "algorithm.kl_coef=0.1"]))


def test_cpu_of_a_process_tree_by_role() -> None:
    assert cpu_seconds(os.getpid()) > 0 and cpu_seconds(2**22 + 12345) == 0.0
    assert set(tree_cpu_by_role(os.getpid())) >= {"launcher"}
    samples = [(1.0, {"controller": 1.0}), (2.0, {"controller": 1.5}), (3.0, {"controller": 2.5})]
    sampler = CpuSampler(0, samples=samples)
    assert sampler.usage(0.5, 2.5) == (1.0, {"controller": 0.5})
    assert sampler.usage(2.5, 2.9) == (0.0, {})


def test_with_two_trl_modes_ratios_are_against_the_faster() -> None:
    rows = [
        summarize(Run("w", system, 1, 90.0, 60.0, 0, records([0.0] * 5, step_s=s, length=length), Path("log")),
                  ARGS, 8, False)
        for system, s, length in [("relayrl-default", 1.0, 47.0), ("trl", 6.0, 50.0), ("trl-cb", 3.0, 49.0)]
    ]  # fmt: skip
    out = aggregate(rows)
    assert out["trl_baseline"] == "trl-cb"
    ratios = out["relayrl_vs_trl"]["relayrl-default/trl"]
    assert ratios["samples_per_s"] == pytest.approx(3.0) and ratios["samples_per_s_by_round"] == pytest.approx([3.0])
    assert ratios["response_len_vs_trl"] == pytest.approx(47.0 / 49.0)
    assert set(out["relayrl_vs_trl"]) == {"relayrl-default/trl"}


def test_the_long_tail_workload_runs_trl_in_both_generation_modes(tmp_path: Path) -> None:
    args = argparse.Namespace(quick=False, steps=6, set=[])
    wl = workload("long-tail", args, tmp_path)
    assert wl.trl_systems == ("trl", "trl-cb") and "default" in wl.variants
    cfg = load_config(DEMO_CONFIG, wl.overrides)
    assert cfg.rollout.max_tokens == 256 and not cfg.rollout.ignore_eos and cfg.trainer.lr <= 1e-6
    specs = [trl_spec(cfg, 6, 2, tmp_path, continuous_batching=cb)["continuous_batching"] for cb in (False, True)]
    assert specs == [False, True]


def test_every_variant_of_every_workload_is_a_valid_config_and_variants_select_them(tmp_path: Path) -> None:
    """The integration test runs one K = 0 / K = 1 pair (``--variants``): the others' configs are checked here."""
    args = argparse.Namespace(quick=True, steps=3, set=[])
    loads = [workload(name, args, tmp_path) for name in WORKLOADS]
    for wl in loads:
        for variant, sets in wl.variants.items():
            cfg = load_config(wl.config, [*UNMEASURED, *wl.overrides, *sets])
            if f"relayrl-{variant}" not in CRITIC_PAIRS:  # PPO with a critic is compared with relayrl's GRPO
                check_mirrorable(cfg)
            assert cfg.trainer.steps == 3, (wl.name, variant)
    picked = select_variants(loads, ["default", "k0-whole", "k1-rollout"])
    assert [list(wl.variants) for wl in picked] == [
        ["k0-whole", "k1-rollout"],
        ["default"],
        ["default"],
        ["default", "k1-rollout"],
    ]
    assert select_variants(loads, None) == loads
    with pytest.raises(SystemExit, match=r"--variants: unknown \['k2'\]"):
        select_variants(loads, ["k1", "k2"])
    with pytest.raises(SystemExit, match="--variants: none of demo's"):
        select_variants(loads, ["k1"])


def test_the_real_workload_runs_the_example_beside_every_trl_precision_and_generation_mode(tmp_path: Path) -> None:
    from relayrl.bench.trl_runner import completion_text, grpo_config

    # the example's prompts are conversational: TRL hands the reward each completion as its assistant messages
    assert completion_text([{"role": "assistant", "content": "3 + 4 = 7"}]) == completion_text("3 + 4 = 7")

    args = argparse.Namespace(quick=False, steps=4, set=[])
    wl = workload("real", args, tmp_path)
    assert wl.config.name == "addition-smollm2.yaml" and set(wl.variants) == {"default", "k1", "k1-rollout"}
    assert wl.trl_systems == ("trl", "trl-cb", "trl-bf16", "trl-cb-bf16")
    cfg = load_config(wl.config, [*UNMEASURED, *wl.overrides])
    check_mirrorable(cfg)
    assert cfg.eval is None and cfg.trainer.steps == 4 and cfg.model.path == "builtin:smollm2-135m-instruct"
    for cb, bf16 in [(False, False), (True, True)]:
        spec = trl_spec(cfg, 4, 2, tmp_path, continuous_batching=cb, bf16=bf16)
        trl = grpo_config(spec)
        assert (trl.use_transformers_continuous_batching, trl.bf16) == (cb, bf16)
        assert (trl.num_generations, trl.max_completion_length) == (cfg.rollout.n, cfg.rollout.max_tokens)


def test_trl_gets_the_prompt_relayrl_renders_its_template_filled_after_the_system_turn(tmp_path: Path) -> None:
    from relayrl.bench.trl_runner import training_rows
    from relayrl.data.dataset import PromptDataset
    from relayrl.models.tiny_chat import build_chat_tokenizer

    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "What is 3 + 4?", "answer": "7", "hint": "add"}\n')
    template, system = "{prompt} Hint: {hint}. Think step by step.", "Answer last."
    overrides = [f"data.path={data}", f"data.prompt_template='{template}'", f"data.system_prompt={system}"]
    cfg = load_config(DEMO_CONFIG, ["model.path=m", *overrides, "data.shuffle=false"])
    spec = trl_spec(cfg, 4, 2, tmp_path)
    tokenizer = build_chat_tokenizer()
    (row,) = training_rows({**spec, "chat_template": "auto"}, tokenizer)
    assert row["prompt"][0] == {"role": "system", "content": system} and row["answer"] == "7"
    trl_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    trl_ids = list(trl_ids["input_ids"] if hasattr(trl_ids, "keys") else trl_ids)
    relayrl = PromptDataset(cfg.data.model_copy(update={"chat_template": "auto"}), tokenizer).record(0)
    assert trl_ids == list(relayrl.token_ids) and relayrl.text == "What is 3 + 4? Hint: add. Think step by step."
    with pytest.raises(ValueError, match=r"data\.system_prompt"):  # no chat template: relayrl refuses the turn too
        training_rows({**spec, "chat_template": "never"}, tokenizer)
