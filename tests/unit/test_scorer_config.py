"""The scorers section and the served rewards' client, without a server: a run names its scorers correctly or is
refused naming the key; the running normalisation is (x - mean) / std over every score so far; a judge's number."""

from __future__ import annotations

import re
import statistics

import pytest

from relayrl.config import ConfigError, parse_config
from relayrl.ops.preflight import check_registry_names
from relayrl.rewards.served import RunningMoments
from relayrl.rollout.engine import create_engine
from relayrl.scorer.models import judged_score, load_scoring_model

BASE = {"model": {"path": "m"}, "data": {"path": "d"}}
DISTILL = {"advantage": "distill", "teacher": "rm"}


def config(fns: dict, fn: str = "exact_match", **scorer) -> dict:
    return {**BASE, "scorers": {"rm": {"model": "rm-dir", **scorer}}, "controller": {"reward": {"fn": fn, "fns": fns}}}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (config({"scorer:judge": 1.0}), "controller.reward.fns: scorer:judge names no scorer (scorers: rm)"),
        (config({}, fn="scorer:rm"), "controller.reward.fn: a served reward goes in controller.reward.fns"),
        (config({"scorer:rm": 1.0}, kind="teacher"), "scorer rm is a teacher: it gives log-probs, not scores"),
        (
            config({"scorer:rm": 1.0}, replicas=0),
            "scorers.rm: replicas is 0 and servers is empty: no scorer would serve",
        ),
        (config({"scorer:rm": 1.0}, servers=["nohost"]), "scorers.rm.servers"),
        (config({"scorer:rm": 1.0}, kind="judge", rubric="rate {response}"), "rubric: a judge's rubric holds"),
        (config({"scorer:rm": 1.0}, max_wait_ms=-1), "scorers.rm.max_wait_ms"),
        (config({"scorer:rm": 1.0}, engine="vllm"), "scorers.rm: engine: only a judge generates on an engine"),
        (config({"scorer:rm": 1.0}, engine_options={"tp_size": 2}), "scorers.rm: engine_options: only a judge"),
        (
            config({"scorer:rm": 1.0}, kind="judge", engine_options={"dtype": "float16", "device": "cpu"}),
            "scorers.rm: engine_options.device (from the scorer's placement), engine_options.dtype (from precision): "
            "set by relayrl itself",
        ),
        ({**config({}), "algorithm": {"advantage": "distill"}}, "algorithm.teacher: set exactly when"),
        ({**config({}), "algorithm": {"teacher": "rm"}}, "algorithm.teacher: set exactly when"),
        (
            {**config({}), "algorithm": {"advantage": "distill", "teacher": "rm"}},
            "algorithm.teacher: 'rm' is no scorer of kind teacher (none)",
        ),
        (
            {**config({}), "algorithm": {"distill_task_advantage": "grpo"}},
            "algorithm.distill_task_advantage: combines a task reward's advantage with distill's",
        ),
        (
            {**config({}, kind="teacher"), "algorithm": DISTILL | {"distill_task_advantage": "gae"}},
            "algorithm.distill_task_advantage: 'gae' is no outcome estimator of the task reward",
        ),
    ],
)
def test_a_scorer_a_run_cannot_use_is_refused_naming_the_key(raw: dict, message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=re.escape(message)):
        parse_config(raw)


def test_relayrl_check_refuses_a_distill_task_advantage_no_estimator_has_naming_the_key() -> None:
    teacher = config({}, kind="teacher")
    check_registry_names(parse_config({**teacher, "algorithm": DISTILL | {"distill_task_advantage": "rloo"}}))
    bad = parse_config({**teacher, "algorithm": DISTILL | {"distill_task_advantage": "grpoo"}})
    with pytest.raises(
        ConfigError, match=re.escape("algorithm.distill_task_advantage: unknown advantage estimator 'grpoo'")
    ):
        check_registry_names(bad)


def test_a_served_reward_beside_a_function_parses() -> None:
    cfg = parse_config(config({"scorer:rm": 1.0, "exact_match": 0.5}, normalize=True))
    assert cfg.scorers["rm"].kind == "classifier" and cfg.scorers["rm"].normalize


def test_running_normalisation_is_over_every_score_so_far() -> None:
    moments, seen = RunningMoments(), []
    for batch in ([1.0, 3.0], [2.0, 10.0, -4.0], [7.0]):
        seen += batch
        mean, std = statistics.fmean(seen), statistics.pstdev(seen)
        assert moments.normalized(batch) == pytest.approx([(x - mean) / std for x in batch], abs=1e-12)
    assert RunningMoments().normalized([5.0]) == [0.0]  # std 0: x - mean


def test_a_judges_score_is_the_first_number_of_its_answer() -> None:
    assert judged_score(" 7/10, fine") == 7.0 and judged_score("score: -2.5") == -2.5
    assert str(judged_score("excellent!")) == "the judge answered 'excellent!': no number"


@pytest.mark.parametrize(
    ("engine", "options", "message"),
    [
        ("vllm", {"max_num_seqs": 4}, ".engine_options: max_num_seqs is set by the vllm engine itself"),
        ("sglang", {"random_seed": 1}, ".engine_options: random_seed is set by the sglang engine itself"),
        ("sglang", {"speculative_algorithm": "EAGLE"}, ".engine_options.speculative_algorithm: speculative decoding"),
    ],
)
def test_an_engine_option_the_adapter_sets_itself_is_refused_naming_the_key_it_came_from(engine, options, message):
    """A judge's engine_options are ``scorers.<name>.engine_options``, a rollout worker's ``rollout.engine_options``
    (checked before the engine is imported or the model read)."""
    judge = {"kind": "judge", "model": "j", "engine": engine, "engine_options": options}
    cfg = parse_config({**BASE, "scorers": {"judge": judge}})
    with pytest.raises(ValueError, match="^" + re.escape("scorers.judge" + message)):
        load_scoring_model(cfg.scorers["judge"], "judge")
    with pytest.raises(ValueError, match="^" + re.escape("rollout" + message)):
        create_engine(engine, model_path="m", **options)


def test_a_resume_drops_the_scorer_addresses_relayrl_up_appended(tmp_path) -> None:
    """`relayrl up` appended its replica's address to scorers.rm.servers in the saved config; the resume starts the
    replica anew on a new port, so the old address is neither a difference from the user's file nor kept."""
    from relayrl.config import dump_config
    from relayrl.ops.resume import resume_config

    raw = {**config({"scorer:rm": 1.0}, servers=["scorer-host:50053"]), "run": {"name": "r", "dir": str(tmp_path)}}
    given = tmp_path / "given.yaml"
    given.write_text(dump_config(parse_config(raw)))
    launched = parse_config(raw)
    launched.scorers["rm"].servers.append("127.0.0.1:41234")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").write_text(dump_config(launched))
    for path, from_saved in ((given, False), (tmp_path / "r" / "config.yaml", True)):
        cfg, changes = resume_config(path, [f"run.dir={tmp_path}", "run.name=r"], from_saved=from_saved)
        assert (cfg.scorers["rm"].servers, changes) == (["scorer-host:50053"], [])
