"""Bad configs fail at start with the key's dotted path and the reason: unknown keys, wrong types, impossible
combinations and security settings; also through ``relayrl controller serve`` (exit code 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relayrl.config import ConfigError, RelayConfig, dump_config, load_config, parse_config

BASE = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}


def config_error(raw: dict) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    return str(err.value)


def with_sections(**sections) -> dict:
    raw = {**BASE}
    for name, values in sections.items():
        raw[name] = values
    return raw


def test_minimal_config_is_valid() -> None:
    cfg = parse_config(BASE)
    assert isinstance(cfg, RelayConfig)
    assert cfg.security.auth_token_env == "RELAYRL_AUTH_TOKEN" and not cfg.security.tls


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({**BASE, "bogus": 1}, "bogus: unknown key"),
        (with_sections(controller={"reward": {"fnn": "x"}}), "controller.reward.fnn: unknown key"),
        (with_sections(rollout={"limits": {"max_prompt": 3}}), "rollout.limits.max_prompt: unknown key"),
        (with_sections(security={"auth_token": "s3cret"}), "security.auth_token: unknown key"),
        ({"data": {"path": "d"}}, "model: Field required"),
    ],
)
def test_unknown_and_missing_keys_name_the_path(raw, expected) -> None:
    assert expected in config_error(raw)


@pytest.mark.parametrize(
    ("sections", "path", "reason"),
    [
        ({"rollout": {"n": "many"}}, "rollout.n", "integer"),
        ({"rollout": {"temperature": -1}}, "rollout.temperature", "greater than or equal to 0"),
        ({"rollout": {"temperature": 1e-3}}, "rollout.temperature", "must be 0 (greedy) or >= 0.01"),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p", "less than or equal to 1"),
        ({"rollout": {"stop": ["</a>", ""]}}, "rollout.stop", "a stop string has 1 to 256 characters, got ''"),
        ({"rollout": {"stop": ["x"] * 17}}, "rollout.stop", "at most 16 stop strings, got 17"),
        ({"trainer": {"gradient_checkpointing": True, "backend": "megatron"}}, "trainer", "fsdp backend only"),
        ({"rollout": {"engine": "tgi"}}, "rollout.engine", "'hf', 'vllm' or 'sglang'"),
        ({"rollout": {"hf_decode": "turbo"}}, "rollout.hf_decode", "'auto', 'fast' or 'transformers'"),
        ({"controller": {"port": 70000}}, "controller.port", "less than or equal to 65535"),
        ({"controller": {"rpc_threads": 1}}, "controller.rpc_threads", "greater than or equal to 4"),
        ({"trainer": {"betas": "fast"}}, "trainer.betas", "tuple"),
        ({"rollout": {"limits": {"max_id_chars": 0}}}, "rollout.limits.max_id_chars", "greater than or equal to 1"),
        ({"security": {"auth_token_env": "NOT A NAME"}}, "security.auth_token_env", "pattern"),
        ({"security": {"require_client_cert": "sometimes"}}, "security.require_client_cert", "boolean"),
        ({"rollout": []}, "rollout", "dictionary"),
        ({"rollout": {"cpus": "0-3,x"}}, "rollout.cpus", "'x' is not a CPU number or range"),
        ({"trainer": {"cpus": "3-1"}}, "trainer.cpus", "range '3-1' ends before it starts"),
    ],
)
def test_wrong_types_and_ranges_name_the_path(sections, path, reason) -> None:
    message = config_error(with_sections(**sections))
    assert message.startswith(f"{path}: ") and reason in message


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        (
            {"controller": {"train_batch_groups": 2}, "trainer": {"mini_batches": 4}},
            ["trainer.mini_batches (4)", "controller.train_batch_groups (2)"],
        ),
        (
            {"controller": {"train_batch_groups": 3}, "rollout": {"n": 3}, "trainer": {"nproc": 2}},
            ["9 samples", "trainer.nproc = 2"],
        ),
        (
            {"trainer": {"nproc": 6, "backend": "megatron", "megatron": {"tensor_parallel": 4}}},
            ["trainer.nproc (6) must be a multiple of", "pipeline_parallel (4)", "TP x PP x DP"],
        ),
        (
            {
                "controller": {"train_batch_groups": 3},
                "rollout": {"n": 3},
                "trainer": {"nproc": 4, "backend": "megatron", "megatron": {"pipeline_parallel": 2}},
            },
            ["9 samples", "2 data-parallel ranks", "trainer.nproc = 4 / (TP x PP = 2)"],
        ),
        ({"rollout": {"n": 1}}, ["rollout.n must be >= 2", "'grpo'"]),
        (
            {"rollout": {"max_tokens": 8}, "controller": {"reward": {"overlong_buffer": 8}}},
            ["controller.reward.overlong_buffer (8)", "rollout.max_tokens (8)"],
        ),
        ({"rollout": {"n": 16, "limits": {"max_n": 8}}}, ["rollout.n (16)", "rollout.limits.max_n (8)"]),
        ({"rollout": {"engine": "vllm", "top_p": 0.9}}, ["rollout.top_p (0.9)", "nucleus"]),
        ({"rollout": {"engine": "sglang", "min_tokens": 4}}, ["rollout.min_tokens (4)", "rollout.ignore_eos"]),
        ({"rollout": {"engine": "vllm", "hf_decode": "fast"}}, ["rollout.hf_decode (fast)", "hf engine only"]),
        ({"security": {"tls_cert": "c.pem"}}, ["security: ", "tls_cert and tls_key"]),
        ({"security": {"tls_ca": "ca.pem"}}, ["security: ", "tls_ca needs tls_cert"]),
        (
            {"security": {"tls_cert": "c.pem", "tls_key": "k.pem", "require_client_cert": True}},
            ["security: ", "require_client_cert needs tls_ca"],
        ),
    ],
)
def test_impossible_combinations_say_why(sections, words) -> None:
    message = config_error(with_sections(**sections))
    for word in words:
        assert word in message


def test_overrides_are_validated_like_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert load_config(path, ["rollout.n=4"]).rollout.n == 4
    with pytest.raises(ConfigError, match=r"^rollout\.nn: unknown key"):
        load_config(path, ["rollout.nn=4"])
    with pytest.raises(ConfigError, match=r"^model\.path\.x: path is not a section"):
        load_config(path, ["model.path.x=1"])
    with pytest.raises(ConfigError, match="overrides look like"):
        load_config(path, ["rollout.n"])


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_config_dump_holds_the_token_variable_name_not_the_token(monkeypatch) -> None:
    secret = "tok-" + "x7" * 20
    monkeypatch.setenv("RELAYRL_AUTH_TOKEN", secret)
    dumped = dump_config(parse_config(BASE))
    assert "RELAYRL_AUTH_TOKEN" in dumped and secret not in dumped


# -- through the command line ------------------------------------------------------------------------
def serve(tmp_path: Path, raw: dict, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "controller", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**(env or {}), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (with_sections(controller={"prot": 1}), "controller.prot: unknown key"),
        (with_sections(rollout={"n": "eight"}), "rollout.n: Input should be a valid integer"),
        (
            with_sections(controller={"train_batch_groups": 1}, trainer={"mini_batches": 2}),
            "trainer.mini_batches (2) exceeds controller.train_batch_groups (1)",
        ),
        (
            with_sections(security={"tls_cert": "/nonexistent/c.pem", "tls_key": "/nonexistent/k.pem"}),
            "security.tls_key: cannot read /nonexistent/k.pem",
        ),
    ],
    ids=["unknown-key", "wrong-type", "combination", "unreadable-cert"],
)
def test_controller_serve_refuses_a_bad_config_with_exit_code_2(tmp_path, raw, expected) -> None:
    result = serve(tmp_path, raw)
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in result.stderr


def test_controller_serve_refuses_a_weak_token_without_printing_it(tmp_path) -> None:
    weak = "short-tok"
    result = serve(tmp_path, BASE, env={"RELAYRL_AUTH_TOKEN": weak})
    assert result.returncode == 2
    assert "RELAYRL_AUTH_TOKEN: the auth token needs at least 16 characters" in result.stderr
    assert weak not in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("staleness", "colocated", "nproc", "rollout", "trainer"),
    [(0, True, 1, 4, 8), (1, True, 2, 2, 4), (0, False, 1, 8, 8), (1, False, 2, 8, 8)],
)
def test_threads_follow_the_loop(staleness, colocated, nproc, rollout, trainer) -> None:
    """8 cores, 2 workers on one machine with the trainer: alternating phases take every core; overlapped,
    the workers share half and the trainer ranks all of them (waiting passively, below); a role on its own
    machine takes every core; an explicit count always wins."""
    from relayrl.cores.threads import torch_threads

    cfg = RelayConfig.model_validate(
        {
            "model": {"path": "m"},
            "data": {"path": "d"},
            "rollout": {"workers": 2},
            "trainer": {"nproc": nproc},
            "controller": {"max_staleness": staleness},
        }
    )
    assert torch_threads(cfg, "rollout", cores=8, colocated=colocated) == rollout
    assert torch_threads(cfg, "trainer", cores=8, colocated=colocated) == trainer
    fixed = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"threads": 3})})
    assert torch_threads(fixed, "rollout", cores=8, colocated=colocated) == 3


@pytest.mark.parametrize(
    ("staleness", "preset", "policy"), [(0, None, None), (1, None, "PASSIVE"), (1, "ACTIVE", None)]
)
def test_an_overlapped_trainer_waits_passively_unless_told_otherwise(monkeypatch, staleness, preset, policy) -> None:
    """The trainer beside its workers yields the cores generation needs only when the two overlap (K >= 1);
    a wait policy the user exported is left alone (the child inherits it)."""
    from relayrl.cores.threads import trainer_env

    if preset is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", preset)
    monkeypatch.setattr("relayrl.cores.threads.available_cores", lambda: 8)
    cfg = RelayConfig.model_validate(
        {"model": {"path": "m"}, "data": {"path": "d"}, "controller": {"max_staleness": staleness}}
    )
    assert trainer_env(cfg).get("OMP_WAIT_POLICY") == policy
    assert trainer_env(cfg)["OMP_NUM_THREADS"] == "8"


@pytest.mark.parametrize(
    ("staleness", "colocated", "cpus", "first"),
    [
        (0, True, {}, True),  # relayrl up at K = 0: a step never trains while an eval decodes on its cores
        (1, True, {}, False),  # overlapped: the trainer waits passively and the workers have half the cores
        (0, False, {}, False),  # roles on machines of their own: the eval runs while the step trains
        (0, True, {"rollout": {"cpus": "0"}, "trainer": {"cpus": "1"}}, False),  # pinned apart: no shared core
        (0, True, {"rollout": {"cpus": "0-1"}, "trainer": {"cpus": "1"}}, True),  # one core shared
    ],
)
def test_the_trainer_waits_for_evals_only_where_they_share_its_cores_at_k0(staleness, colocated, cpus, first) -> None:
    from relayrl.cores.threads import evals_first

    sections = {"model": {"path": "m"}, "data": {"path": "d"}, "controller": {"max_staleness": staleness}}
    cfg = RelayConfig.model_validate(sections | cpus)
    assert evals_first(cfg, colocated=colocated) is first


def test_megatron_data_parallel_is_what_tp_and_pp_leave() -> None:
    cfg = parse_config(
        with_sections(
            controller={"train_batch_groups": 3},
            rollout={"n": 2},
            trainer={"nproc": 4, "backend": "megatron", "megatron": {"tensor_parallel": 2}},
        )
    )  # 6 samples: divisible by DP = 4 / 2 = 2, though not by nproc
    assert cfg.trainer.data_parallel == 2
    assert cfg.trainer.model_copy(update={"backend": "fsdp"}).data_parallel == 4


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        ({"controller": {"max_staleness": 1}}, ["controller.max_staleness: 0 (is 1)"]),
        ({"algorithm": {"old_logprobs": "recompute"}}, ["algorithm.old_logprobs: auto (is recompute)"]),
        ({"weight_sync": {"verify": "off"}}, ["weight_sync.verify"]),
        ({"trainer": {"epochs": 2}}, ["trainer.epochs: 1 (is 2)"]),
        ({"trainer": {"backend": "megatron"}}, ["trainer.backend: fsdp (is megatron)"]),
        ({"algorithm": {"advantage": "reinforce_pp"}}, ["algorithm.advantage", "batch-wide"]),
        ({"trainer": {"nproc": 4}, "rollout": {"n": 2}}, ["rollout.n >= the trainer's data-parallel ranks (4"]),
    ],
)
def test_stream_on_refuses_what_cannot_stream_exactly_and_auto_trains_whole_there(sections, words) -> None:
    sections = {name: dict(values) for name, values in sections.items()}
    sections.setdefault("trainer", {})["stream"] = "auto"
    auto = parse_config(with_sections(**sections))
    assert not auto.streams  # auto: whole batches
    sections.setdefault("trainer", {})["stream"] = "on"
    message = config_error(with_sections(**sections))
    assert message.startswith("trainer.stream: 'on' needs")
    for word in words:
        assert word in message


def test_stream_is_opt_in_and_auto_streams_the_synchronous_default() -> None:
    assert parse_config(BASE).trainer.stream == "off" and not parse_config(BASE).streams
    assert parse_config(with_sections(trainer={"stream": "auto"})).streams
    assert parse_config(with_sections(trainer={"stream": "on"})).streams
    assert not parse_config(with_sections(trainer={"stream": "off"})).streams
    raw = yaml.safe_load("trainer: {stream: off}")  # YAML's bare off is false
    assert parse_config({**BASE, **raw}).trainer.stream == "off"
    assert "trainer.stream: Input should be 'auto', 'on' or 'off'" in config_error(with_sections(trainer={"stream": 1}))
