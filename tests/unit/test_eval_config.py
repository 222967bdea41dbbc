"""The eval section: its greedy defaults, and each bad input refused at start in one line naming the key (a missing
set, k > n, a metric the reward cannot give, a best metric the eval does not report)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from relayrl.config import ConfigError, EvalConfig, load_config
from relayrl.ops.preflight import check_eval

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "digits.yaml"
GUESS = ROOT / "examples" / "guess.yaml"


def demo(*sets: str, config: Path = DEMO):
    return load_config(config, ["eval.sets.heldout.path=builtin:digits-heldout", *sets])


def test_a_set_renders_with_datas_keys_unless_it_sets_its_own_and_the_saved_config_says_so() -> None:
    from relayrl.config import dump_config, parse_config

    data = ["data.prompt_key=question", "data.system_prompt=Be brief.", "data.prompt_template='{question} ='"]
    cfg = demo(
        *data, "eval.sets.other.path=x.jsonl", "eval.sets.other.prompt_key=q", "eval.sets.other.prompt_template='{q}'"
    )
    heldout, other = cfg.eval.sets["heldout"], cfg.eval.sets["other"]
    assert (heldout.prompt_key, heldout.system_prompt, heldout.prompt_template) == (
        "question",
        "Be brief.",
        "{question} =",
    )
    assert (other.prompt_key, other.system_prompt, other.prompt_template) == ("q", "Be brief.", "{q}")
    assert heldout.shuffle is False and heldout.path == "builtin:digits-heldout"  # the set's own, never data's
    import yaml

    assert parse_config(yaml.safe_load(dump_config(cfg))).eval == cfg.eval  # written out whole: a resume reads it


def test_the_eval_samples_greedily_once_per_prompt_by_default() -> None:
    ecfg = EvalConfig(sets={"heldout": {"path": "builtin:digits-heldout"}})
    assert (ecfg.temperature, ecfg.n, ecfg.k, ecfg.metrics) == (0.0, 1, [1], ["mean", "pass"])
    assert (ecfg.before_train, ecfg.after_train, ecfg.every, ecfg.pass_threshold) == (True, True, 0, None)
    assert ecfg.sets["heldout"].shuffle is False
    check_eval(demo())  # the demo's reward with mean and pass@1: nothing to refuse


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["eval.k=[1, 4]"], "eval.k: [4] exceeds eval.n (1): pass@k needs k <= n"),
        (["eval.n=2", "eval.temperature=1.0", "eval.metrics=[pass^]", "eval.k=[3]"], "eval.k: [3] exceeds eval.n (2)"),
        (["eval.metrics=[]"], "eval.metrics: name at least one of mean, pass, pass^, maj"),
        (["eval.metrics=[best]"], "eval.metrics.0: Input should be 'mean', 'pass', 'pass^' or 'maj'"),
        (["eval.temperature=0.001"], "eval.temperature: must be 0 (greedy) or >="),
        (["eval.best.metric=other/pass@1"], "eval.best.metric: 'other/pass@1' names no eval set"),
        (["eval.n=100", "eval.temperature=1.0"], "eval.n (100) exceeds rollout.limits.max_n (64)"),
        (["eval.n=4", "eval.k=[1, 4]"], "eval.n: 4 samples at eval.temperature 0 are one greedy response 4 times"),
        (["eval.sets.a/b.path=x"], "eval.sets: set name 'a/b'"),
        (["eval.sets.heldout.path=builtin:digit"], "eval.sets.heldout.path: unknown built-in 'builtin:digit'"),
    ],
)
def test_a_bad_eval_section_is_refused_at_load_naming_the_key(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        demo(*sets)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("sets", "config", "message"),
    [
        (["eval.sets.heldout.path=/nonexistent/heldout.jsonl"], DEMO, "eval.sets.heldout.path: /nonexistent/heldout"),
        (["eval.metrics=[mean, maj]"], DEMO, "maj@n needs an answer to vote on, and reward 'prefix_match'"),
        (["eval.metrics=[maj]", "eval.sets.heldout.path=examples/guess-tasks.jsonl"], GUESS, "maj@n votes"),
        (["eval.metrics=[maj]", "controller.reward.fns={prefix_match: 1}"], DEMO, "controller.reward.fns ['prefix_"),
        (["eval.answer_extractor=lastword"], DEMO, "eval.answer_extractor: unknown extractor 'lastword'"),
        (["eval.best.metric=heldout/pass@4"], DEMO, "eval.best.metric: 'heldout/pass@4' is not reported"),
    ],
)
def test_an_eval_the_run_cannot_compute_is_refused_at_start_naming_the_key(sets, config, message) -> None:
    with pytest.raises(ConfigError) as err:
        check_eval(demo(*sets, config=config))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert check_eval(demo("eval.metrics=[maj]", "eval.answer_extractor=first_word")) is None
    assert check_eval(demo("eval.metrics=[maj]", "controller.reward.fns={exact_match: 0.5, prefix_match: 0.3}")) is None


def test_relayrl_check_refuses_bad_eval_input_in_one_line(tmp_path: Path) -> None:
    cases = [
        ("eval.sets.heldout.path=/nonexistent/heldout.jsonl", "eval.sets.heldout.path: /nonexistent/heldout.jsonl"),
        ("eval.k=[2]", "eval.k: [2] exceeds eval.n (1)"),
    ]

    def check(case: tuple[str, str]) -> tuple[subprocess.CompletedProcess, str]:
        sets = [f"run.dir={tmp_path}", "eval.sets.heldout.path=builtin:digits-heldout", case[0]]
        argv = ["check", str(DEMO), *(arg for s in sets for arg in ("--set", s))]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-m", "relayrl.cli", *argv], capture_output=True, text=True, env=env, cwd=ROOT
        )
        return done, case[1]

    with ThreadPoolExecutor(2) as pool:
        for done, expected in pool.map(check, cases):
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr
