"""``relayrl bench tta``'s arithmetic: the first eval at the target on each system's clock, medians over seeds, the
ratios TRL / relayrl, and one file per settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.bench.e2e import REAL_CONFIG
from relayrl.bench.tta import aggregate, first_at_target, launch_until, merge, parse_args, reached, settings


def steps(n: int, *, step_s: float = 10.0, samples: int = 64, paused: list[float] | None = None) -> list[dict]:
    out = [{"step": i + 1, "time": 1000.0 + step_s * (i + 1), "samples_generated": samples} for i in range(n)]
    for record, pause in zip(out, paused or []):
        record["paused_seconds"] = pause
    return out


def evals(curve: dict[int, float]) -> list[dict]:
    return [{"eval": "heldout", "step": v, "mean@1": value} for v, value in curve.items()]


def test_the_first_eval_at_the_target_gives_the_end_of_its_step_and_the_samples_so_far() -> None:
    hit = first_at_target(evals({0: 0.45, 2: 0.7, 4: 0.85, 6: 0.8}), steps(6), launched=990.0, target=0.8)
    assert hit["reached"] and hit["version"] == 4 and hit["value"] == 0.85
    assert hit["wall_s"] == pytest.approx(1040.0 - 990.0) and hit["samples"] == 4 * 64
    assert [point[0] for point in hit["curve"]] == [0, 2, 4, 6] and hit["curve"][0][2] == 0.0
    miss = first_at_target(evals({0: 0.45, 2: 0.7}), steps(2), launched=990.0, target=0.8)
    assert not miss["reached"] and miss["wall_s"] is None and miss["samples"] is None and len(miss["curve"]) == 2


def test_trl_clock_is_net_of_the_seconds_it_waited_for_saves_and_scoring() -> None:
    # the pause of step 2's checkpoint falls in step 3 and later: step 4's end is 30 s of waiting later on the wall
    records = steps(4, paused=[0.0, 0.0, 30.0, 30.0])
    hit = first_at_target(evals({2: 0.5, 4: 0.9}), records, launched=1000.0, target=0.9)
    assert hit["version"] == 4 and hit["wall_s"] == pytest.approx(40.0 - 30.0)


def test_a_base_model_already_at_the_target_reaches_it_at_zero_seconds() -> None:
    hit = first_at_target(evals({0: 0.9}), [], launched=5.0, target=0.8)
    assert hit["reached"] and hit["version"] == 0 and hit["wall_s"] == 0.0 and hit["samples"] == 0


def test_an_eval_whose_step_has_no_record_does_not_count() -> None:
    hit = first_at_target(evals({2: 0.95}), steps(1), launched=1000.0, target=0.8)  # step 2's line was not written
    assert not hit["reached"]


def row(system: str, seed: int, wall_s: float | None, samples: int | None, per_s: float) -> dict:
    target = {"reached": wall_s is not None, "wall_s": wall_s, "samples": samples}
    return {"system": system, "seed": seed, "samples_per_s": per_s, "to_target": target}


def test_medians_over_seeds_and_trl_over_relayrl_ratios() -> None:
    rows = [
        row("relayrl-default", 0, 100.0, 256, 4.0), row("relayrl-default", 1, 140.0, 384, 6.0),
        row("trl", 0, 600.0, 256, 1.0), row("trl", 1, 800.0, 384, 1.0), row("trl", 2, None, None, 1.0),
    ]  # fmt: skip
    out = aggregate(rows)
    mine, trl = out["systems"]["relayrl-default"], out["systems"]["trl"]
    assert mine["wall_s_to_target"] == 120.0 and mine["samples_to_target"] == 320 and mine["samples_per_s"] == 5.0
    assert trl["seeds"] == [0, 1, 2] and trl["seeds_reached"] == 2 and trl["wall_s_to_target"] == 700.0
    ratio = out["trl_over_relayrl"]["trl/relayrl-default"]
    assert ratio["wall_s_to_target"] == pytest.approx(700.0 / 120.0) and ratio["samples_to_target"] == 1.0
    assert ratio["samples_per_s"] == 5.0
    unreached = aggregate([row("relayrl-default", 0, None, None, 4.0), row("trl", 0, 600.0, 256, 1.0)])
    assert unreached["trl_over_relayrl"]["trl/relayrl-default"]["wall_s_to_target"] is None


def test_rows_merge_into_one_file_only_under_the_same_settings(tmp_path: Path) -> None:
    out = tmp_path / "tta.json"
    shared = settings(parse_args(["--system", "trl", "--out", str(out)]))
    first = merge(out, shared, row("trl", 0, 600.0, 256, 1.0), ["cmd"])
    out.write_text(json.dumps(first))
    again = merge(out, shared, row("trl", 0, 500.0, 256, 1.0), ["cmd"])  # the same system and seed: replaced
    assert len(again["runs"]) == 1 and again["systems"]["trl"]["wall_s_to_target"] == 500.0
    other = settings(parse_args(["--system", "trl", "--out", str(out), "--target", "0.9"]))
    with pytest.raises(SystemExit, match=r"other settings \(\['target'\]\)"):
        merge(out, other, row("trl", 1, 600.0, 256, 1.0), ["cmd"])
    reasoning = str(REAL_CONFIG.parent / "reasoning-smollm2.yaml")  # recorded relative to the repository
    workload = settings(parse_args(["--system", "trl", "--out", str(out), "--config", reasoning]))
    assert (shared["config"], workload["config"]) == (
        "examples/addition-smollm2.yaml",
        "examples/reasoning-smollm2.yaml",
    )
    with pytest.raises(SystemExit, match=r"other settings \(\['config'\]\)"):  # another workload: its own file
        merge(out, workload, row("trl", 1, 600.0, 256, 1.0), ["cmd"])


def test_a_run_is_stopped_once_an_eval_line_reaches_the_target(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert not reached(metrics, 0.8, "mean@1")  # not written yet
    metrics.write_text(json.dumps({"step": 1, "reward_mean": 0.9}) + "\n" + json.dumps(evals({2: 0.75})[0]) + "\n")
    assert not reached(metrics, 0.8, "mean@1")  # a training reward above the target is no eval
    metrics.write_text(metrics.read_text() + json.dumps(evals({4: 0.8})[0]) + "\n" + '{"step": 5, "ti')
    assert reached(metrics, 0.8, "mean@1")


def test_a_run_past_its_timeout_is_stopped_and_its_steps_still_count(tmp_path: Path) -> None:
    args = parse_args(["--system", "trl", "--out", "x.json", "--timeout-s", "0.5"])
    sleeper = ["sleep", "60"]
    stopped = launch_until(sleeper, tmp_path / "log", {}, tmp_path / "metrics.jsonl", args)
    assert stopped[1:] == (0, "timeout")  # a cap, like the target: the run's figures are a lower bound
    (tmp_path / "metrics.jsonl").write_text(json.dumps(evals({0: 0.9})[0]) + "\n")
    assert launch_until(sleeper, tmp_path / "log", {}, tmp_path / "metrics.jsonl", args)[1:] == (0, "target")
    assert launch_until(["false"], tmp_path / "log", {}, tmp_path / "none.jsonl", args)[1:] == (1, "exit")


@pytest.mark.parametrize(
    ("argv", "field"),
    [(["--target", "1.5"], "--target"), (["--every", "0"], "--every"), (["--system", "nope"], "--system")],
)
def test_bad_arguments_are_refused_naming_the_flag(argv: list[str], field: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--system", "trl", "--out", "x.json", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]
