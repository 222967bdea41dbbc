"""What `relayrl` refuses before it starts anything, as a user meets it: exit code 2 and one stderr line that
names the key or flag; no run directory and nothing built left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from cli_testing import ROOT, relayrl, relayrl_process, relayrl_run

from relayrl.config import dump_config, load_config
from relayrl.models.families import write_family_model

DEMO = ROOT / "examples" / "digits.yaml"
NO_ADDRESS = {"RELAYRL_CONTROLLER": ""}  # an operator's shell may have one set


def saved_run(tmp_path: Path, *sets: str) -> Path:
    """A stopped run of the demo config: its run directory with the saved config and 3 steps of metrics."""
    cfg = load_config(DEMO, [f"run.dir={tmp_path / 'runs'}", "run.name=try", *sets])
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.yaml").write_text(dump_config(cfg))
    (cfg.run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 3)))
    return cfg.run_dir


def test_resume_with_a_forgotten_set_is_refused_naming_the_key(tmp_path: Path) -> None:
    run_dir = saved_run(tmp_path, "trainer.steps=2000")
    saved = (run_dir / "config.yaml").read_text()
    base = ["up", str(DEMO), "--set", f"run.dir={tmp_path / 'runs'}", "--set", "run.name=try", "--resume"]
    line = relayrl(*base)
    assert "trainer.steps (2000 in the run, 200 now)" in line and "--resume" in line
    # a key that is not safe to change is refused even when set explicitly; every differing key is listed
    line = relayrl(*base, "--set", "trainer.lr=0.1", "--set", "rollout.n=8", "--set", "trainer.steps=2000")
    differing = line.split(" in ", 1)[1].split("; ")[0]
    assert "trainer.lr (0.002 in the run, 0.1 now)" in differing and "rollout.n (16 in the run, 8 now)" in differing
    assert "trainer.steps" not in differing
    # a safe key set explicitly passes this check; fewer steps than trained is refused
    assert relayrl(*base, "--set", "trainer.steps=2").startswith("relayrl: config error: trainer.steps: 2, and ")
    assert (run_dir / "config.yaml").read_text() == saved and not (run_dir / "resume.log").exists()


def test_resume_from_the_run_directory_alone_and_an_unsafe_change_only_when_named(tmp_path: Path) -> None:
    """`relayrl up --resume runs/NAME` needs no config file and none of the original --set; an unsafe key (lr)
    changes only when --allow-change names it, and the change is recorded in resume.log."""
    from relayrl.ops.resume import record_changes, resume_run

    run_dir = saved_run(tmp_path, "trainer.steps=20")
    code, stdout, stderr = relayrl_run("check", "--resume", str(run_dir), cwd=tmp_path)
    assert code == 0 and f"`relayrl up` resumes {run_dir}" in stdout, stderr
    line = relayrl("up", "--resume", str(run_dir), "--set", "trainer.lr=0.0005", cwd=tmp_path)
    assert "trainer.lr (0.002 in the run, 0.0005 now)" in line and "--allow-change KEY" in line
    line = relayrl("up", "--resume", str(run_dir), "--allow-change", "trainer.lr", cwd=tmp_path)
    assert "--allow-change trainer.lr: the resume does not change it" in line
    assert "--allow-change: only with --resume" in relayrl("up", str(DEMO), "--allow-change", "trainer.lr")
    cfg, changes = resume_run(run_dir, ["trainer.lr=0.0005", "trainer.steps=30"], ["trainer.lr"])
    assert changes == ["trainer.lr: 0.002 -> 0.0005 (--allow-change)", "trainer.steps: 20 -> 30"]
    record_changes(cfg, changes)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["lr"] == 0.0005
    logged = (run_dir / "resume.log").read_text()
    assert "resumed; trainer.lr: 0.002 -> 0.0005 (--allow-change); trainer.steps: 20 -> 30" in logged
    assert not (tmp_path / "runs" / "try" / "logs").exists()  # nothing started


def test_resume_with_more_steps_under_a_decay_or_warmup_ratio_needs_allow_change(tmp_path: Path) -> None:
    """trainer.steps spreads a cosine decay and a warmup_ratio: a new count changes the lr of the steps still to
    train, so it is refused naming the key and why, and passes with --allow-change trainer.steps."""
    from relayrl.ops.resume import resume_run

    for n, sets in enumerate([("trainer.lr_schedule=cosine",), ("trainer.warmup_ratio=0.25",)]):
        run_dir = saved_run(tmp_path / str(n), "trainer.steps=20", *sets)  # 3 steps trained
        line = relayrl("up", "--resume", str(run_dir), "--set", "trainer.steps=30", cwd=tmp_path)
        assert line.startswith("relayrl: config error: trainer.steps: 20 -> 30 reshapes the lr of the steps still")
        assert "step 4 trains at lr" in line and "--allow-change trainer.steps" in line
        assert not (run_dir / "resume.log").exists()
        _, changes = resume_run(run_dir, ["trainer.steps=30"], ["trainer.steps"])
        assert changes == ["trainer.steps: 20 -> 30 (--allow-change)"]
    run_dir = saved_run(tmp_path / "fixed", "trainer.steps=20", "trainer.warmup_steps=5")  # no lr depends on steps
    assert resume_run(run_dir, ["trainer.steps=30"])[1] == ["trainer.steps: 20 -> 30"]


def test_resume_of_a_run_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    line = relayrl("up", str(DEMO), "--set", f"run.dir={tmp_path / 'runs'}", "--set", "run.name=nope", "--resume")
    assert "--resume: no run at" in line and "nope" in line
    assert not (tmp_path / "runs").exists()


def test_a_safe_change_on_resume_is_recorded_in_the_run(tmp_path: Path) -> None:
    from relayrl.ops.resume import record_changes, resume_config

    run_dir = saved_run(tmp_path, "trainer.steps=20", "controller.port=43210")  # the port its start chose
    sets = [f"run.dir={tmp_path / 'runs'}", "run.name=try", "trainer.steps=30", "controller.port=0"]
    cfg, changes = resume_config(DEMO, sets)
    assert changes == ["trainer.steps: 20 -> 30"] and cfg.controller.port == 43210  # its address stays
    record_changes(cfg, changes)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["steps"] == 30
    assert (run_dir / "resume.log").read_text().strip().endswith("resumed; trainer.steps: 20 -> 30")


def test_the_removed_build_if_missing_keys_name_their_replacement(tmp_path: Path) -> None:
    for key, replacement in [
        ("model.build_tiny_if_missing", "model.path: builtin:tiny-qwen2"),
        ("data.generate_digits_if_missing", "data.path: builtin:digits"),
    ]:
        line = relayrl("up", str(DEMO), "--set", f"run.dir={tmp_path / 'runs'}", "--set", f"{key}=true")
        assert line.startswith(f"relayrl: config error: {key}: removed; write {replacement}")
    assert not (tmp_path / "runs").exists()


def test_a_mistyped_data_path_in_a_copy_of_the_demo_builds_nothing(tmp_path: Path) -> None:
    raw = yaml.safe_load(DEMO.read_text())
    raw["run"]["dir"] = str(tmp_path / "runs")
    for path, expected in [
        ("builtin:digit", "data.path: unknown built-in 'builtin:digit'"),
        ("digts.jsonl", "data.path: digts.jsonl: no such file or directory"),
        ("assets/digits/trian.jsonl", "data.path: assets/digits/trian.jsonl: no such file or directory"),
    ]:
        raw["data"]["path"] = path
        config = tmp_path / "mine.yaml"
        config.write_text(yaml.safe_dump(raw))
        assert expected in relayrl("up", str(config), cwd=tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]  # no run directory, no data, no model


MISSING = "/nonexistent/relayrl-test-path"
PROMPTS = str(ROOT / "tests" / "unit" / "test_cli_refusals.py")  # exists: the refusal is about the other flag
GUESS = "relayrl.env.examples.guess:GuessNumber"
ANY = "127.0.0.1:1"
# subcommand -> (missing path, bad port, bad value) argvs, each with the flag or key its one line must name;
# None where the subcommand has no such flag
SUBCOMMANDS = {
    "controller serve": (
        (["controller", "serve", "--config", MISSING], "--config"),
        (["controller", "serve", "--config", str(DEMO), "--port", "99999"], "--port"),
        (["controller", "serve", "--config", str(DEMO), "--set", "trainer.steps=0"], "trainer.steps"),
    ),
    "rollout serve": (
        (["rollout", "serve", "--config", MISSING], "--config"),
        (["rollout", "serve", "--config", str(DEMO), "--port", "70000"], "--port"),
        (["rollout", "serve", "--config", str(DEMO), "--advertise", "http://h:1"], "--advertise"),
    ),
    "env serve": (
        (["env", "serve", GUESS, "--config", MISSING], "--config"),
        (["env", "serve", GUESS, "--port", "99999"], "--port"),
        (["env", "serve", GUESS, "--processes", "0"], "--processes"),
    ),
    "trainer run": (
        (["trainer", "run", "--config", MISSING, "--controller", ANY], "--config"),
        (["trainer", "run", "--config", str(DEMO), "--controller", "127.0.0.1:99999"], "--controller"),
        (["trainer", "run", "--config", str(DEMO), "--controller", ANY, "--set", "trainer.lr=-1"], "trainer.lr"),
    ),
    "up": (
        (["up", MISSING], "config"),
        (["up", str(DEMO), "--set", "controller.port=99999"], "controller.port"),
        (["up", str(DEMO), "--set", "rollout.n=x"], "rollout.n"),
    ),
    "check": (
        (["check", MISSING], "config"),
        (["check", str(DEMO), "--set", "controller.port=-1"], "controller.port"),
        (["check", str(DEMO), "--set", "trainer.steps"], "--set"),
    ),
    "submit": (
        (["submit", MISSING, "--controller", ANY], "prompts"),
        (["submit", PROMPTS, "--controller", "127.0.0.1:99999"], "--controller"),
        (["submit", PROMPTS, "--controller", ANY, "--n", "0"], "--n"),
    ),
    "status": (
        (["status", "--run", MISSING], "--run"),
        (["status", "--controller", "localhost"], "--controller"),
        (["status", "--controller", ANY, "--watch", "0"], "--watch"),
    ),
    "weights sync": (
        (["weights", "sync", "--tls-ca", MISSING], "--tls-ca"),
        (["weights", "sync", "--controller", "http://127.0.0.1:50051"], "--controller"),
        (["weights", "sync", "--controller", ANY, "--wait-timeout", "-1"], "--wait-timeout"),
    ),
    "weights status": (
        (["weights", "status", "--tls-cert", MISSING], "--tls-cert"),
        (["weights", "status", "--controller", "127.0.0.1:"], "--controller"),
        (["weights", "status", "--controller", ANY, "--timeout", "0"], "--timeout"),
    ),
    "pause": (
        (["pause", "--tls-key", MISSING], "--tls-key"),
        (["pause", "--controller", "127.0.0.1:0"], "--controller"),
        (["pause", "--controller", ANY, "--attempts", "x"], "--attempts"),
    ),
    "unpause": (
        (["unpause", "--run", MISSING], "--run"),
        (["unpause", "--controller", "127.0.0.1:-5"], "--controller"),
        (["unpause", "--controller", ANY, "--attempts", "-1"], "--attempts"),
    ),
    "resume": (
        (["resume", "--run", MISSING], "--run"),
        (["resume", "--controller", "grpc://127.0.0.1:50051"], "--controller"),
        (["resume", "--controller", ANY, "--timeout", "-3"], "--timeout"),
    ),
    "drain": (
        (["drain", "rollout-0", "--run", MISSING], "--run"),
        (["drain", "rollout-0", "--controller", ":50051"], "--controller"),
        (["drain", "rollout-0", "--controller", ANY, "--wait-timeout", "0"], "--wait-timeout"),
    ),
    "scale rollout": (
        (["scale", "rollout", "2", "--tls-ca", MISSING], "--tls-ca"),
        (["scale", "rollout", "2", "--controller", "127.0.0.1:65536"], "--controller"),
        (["scale", "rollout", "0", "--controller", ANY], "replicas"),
    ),
    "bench load": (
        (["bench", "load", "--workdir", MISSING], "--workdir"),
        (["bench", "load", "--controller", "127.0.0.1:99999"], "--controller"),
        (["bench", "load", "--workers", "0"], "--workers"),
    ),
    "bench controller": (
        (["bench", "controller", "--workdir", MISSING], "--workdir"),
        None,
        (["bench", "controller", "--n", "x"], "--n"),
    ),
    "bench rollout": (
        (["bench", "rollout", "--workdir", MISSING], "--workdir"),
        None,
        (["bench", "rollout", "--prompts", "0"], "--prompts"),
    ),
    "bench weightsync": (
        (["bench", "weightsync", "--tmp-dir", MISSING], "--tmp-dir"),
        None,
        (["bench", "weightsync", "--tensors", "x"], "--tensors"),
    ),
    "bench e2e": (
        (["bench", "e2e", "--workdir", MISSING], "--workdir"),
        None,
        (["bench", "e2e", "--rounds", "x"], "--rounds"),
    ),
    "check-engine": (
        (["check-engine", "--engine", "hf", "--model", MISSING], "--model"),
        None,
        (["check-engine", "--engine", "tgi", "--model", str(ROOT)], "--engine"),
    ),
}


ROLES = {"controller serve", "rollout serve", "env serve", "trainer run"}  # processes (cli_testing.relayrl_run)


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_subcommand_refuses_a_missing_path_a_bad_port_and_a_bad_value_in_one_line(command, tmp_path) -> None:
    cases = [case for case in SUBCOMMANDS[command] if case is not None]
    if command in ROLES:
        with ThreadPoolExecutor(len(cases)) as pool:  # independent processes: side by side
            lines = list(pool.map(lambda case: relayrl_process(*case[0], cwd=tmp_path, env=NO_ADDRESS), cases))
    else:
        lines = [relayrl(*argv, cwd=tmp_path, env=NO_ADDRESS) for argv, _ in cases]
    for (argv, flag), line in zip(cases, lines, strict=True):
        assert flag in line, (argv, line)
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_the_controller_address_comes_from_the_run_directory(tmp_path: Path) -> None:
    line = relayrl("status", cwd=tmp_path, env=NO_ADDRESS)
    assert "--controller: no controller address: give --controller HOST:PORT, set RELAYRL_CONTROLLER" in line
    assert "RELAYRL_CONTROLLER: 'localhost' has no port" in relayrl("status", env={"RELAYRL_CONTROLLER": "localhost"})
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    assert "has no controller.address" in relayrl("status", "--run", str(run), env=NO_ADDRESS)
    (run / "controller.address").write_text("127.0.0.1:99999")
    assert "controller.address: port 99999 is out of range" in relayrl("status", "--run", str(run), env=NO_ADDRESS)


def test_status_of_a_run_whose_controller_is_gone_reads_the_run_directory(tmp_path: Path) -> None:
    """`relayrl status --run` of a stopped run (nothing listens at its controller.address) says how far it got and
    when; of a finished one, its summary and when; exit 0 at once, no UNAVAILABLE after the client's retries."""
    from relayrl.launcher import summary

    run_dir = saved_run(tmp_path, "trainer.steps=20")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        (run_dir / "controller.address").write_text(f"127.0.0.1:{closed.getsockname()[1]}")
    steps = [{"step": s, "reward_mean": 0.5, "sync_seconds": 0.1} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(step) + "\n" for step in steps))

    def status(*flags: str) -> str:
        code, stdout, stderr = relayrl_run("status", "--run", str(run_dir), *flags, env=NO_ADDRESS)
        assert code == 0 and not stderr.strip(), (code, stderr[-2000:])
        return " ".join(stdout.split())

    stopped = status()
    assert "not running (no controller answers) and not finished: 3 of 20 steps trained, the last at" in stopped
    assert json.loads(status("--json"))["state"] == "stopped"
    summary(load_config(run_dir / "config.yaml"), run_dir / "metrics.jsonl", 12.0)  # as `relayrl up` ends a run
    finished = status()
    assert f"run {run_dir}: finished at " in finished and "after 3 steps in 12 s" in finished
    record = json.loads(status("--json"))
    assert record["state"] == "finished" and record["steps"] == 3 and record["at"].endswith("UTC")


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("run:\n  name: x\nmodel:\n  path: [unclosed\n")
    for command in ("up", "check"):
        line = relayrl(command, str(config), cwd=tmp_path)
        assert f"{config}:5:1: YAML syntax error" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_each_bad_start_up_input_is_one_line_naming_the_key_and_no_run_directory(
    tmp_path: Path, tiny_model_dir: Path, busy_port: int
) -> None:
    """Every start-up check (relayrl.ops.preflight: CHECKS and HEAVY_CHECKS) refuses its cases in `relayrl check`,
    and the first case of each in `relayrl up` (which runs the same checks), before a run directory exists. The
    first heavy check's `up` runs as `relayrl up` does by default, its fork server started beside the heavy checks
    (and killed at the refusal), in a process of its own; the other heavy checks' `up` run here, without one."""
    from relayrl.ops.preflight import CHECKS, HEAVY_CHECKS

    no_config = tmp_path / "not-a-model"
    no_config.mkdir()
    bad_tokenizer = tmp_path / "bad-tokenizer"  # the last check, after the fork server started, refuses it
    bad_tokenizer.mkdir()  # (and kills that server)
    (bad_tokenizer / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    (bad_tokenizer / "tokenizer.json").write_text("{not json")
    (bad_tokenizer / "model.safetensors").write_bytes(b"")  # present: the weights are the roles' to load
    gemma2 = write_family_model("gemma2", tmp_path / "gemma2")  # eager: its soft-capped attention is not SDPA's
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    bad_rows = tmp_path / "rows.jsonl"
    bad_rows.write_text('{"question": "1 + 1 =", "answer": "2"}\n')
    good_rows = tmp_path / "good.jsonl"
    good_rows.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    no_answer = tmp_path / "no-answer.jsonl"  # later rows without the answer would train against "None"
    no_answer.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": "2 + 2 ="}\n')
    broken_row = tmp_path / "broken.jsonl"
    broken_row.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n\n{"prompt": "2 + 2 =", \n')
    (tmp_path / "typo_reward.py").write_text("def reward(response, answer)\n    return 1.0\n")
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        nobody = closed.getsockname()[1]
    cases = [  # (the check that refuses it, --set values, what its one line says)
        ("check_placement", ["supervisor.gpus=1"], "supervisor.gpus: the run needs 3 GPUs"),
        ("check_cpus", ["trainer.cpus=4095"], "trainer.cpus: "),
        ("check_model", ["model.path=/nonexistent/model"], "model.path: /nonexistent/model: no such directory"),
        ("check_model", [f"model.path={no_config}"], f"model.path: {no_config} has no config.json"),
        ("check_model", [f"model.path={no_weights}"], f"model.path: {no_weights} has no weights (no *.safetensors"),
        ("check_data", ["data.path=/nonexistent/train.jsonl"], "data.path: /nonexistent/train.jsonl: no such file"),
        ("check_data", [f"data.path={bad_rows}"], "data.prompt_key: column 'prompt' not in the first row"),
        ("check_data", [f"data.path={broken_row}"], f"data.path: {broken_row}:3: not JSON"),
        ("check_data", [f"data.path={no_answer}"], f"data.answer_key: {no_answer}:2: the row has no 'answer'"),
        (
            "check_data",
            [f"data.path={good_rows}", "data.prompt_template=Solve {prompt} in {colour}"],
            "data.prompt_template: reads ['colour'], not in the first row",
        ),
        (
            "check_reward",
            ["controller.reward.fn=no_such_module:score"],
            "controller.reward.fn: reward function 'no_such_module:score' cannot be imported: no module named "
            f"'no_such_module' on PYTHONPATH ({ROOT}) and the working directory ({tmp_path})",
        ),
        (
            "check_reward",
            ["controller.reward.fn=typo_reward:reward"],
            f"reward function 'typo_reward:reward' cannot be imported: {tmp_path / 'typo_reward.py'}:1: SyntaxError",
        ),
        ("check_reward", ["controller.reward.fn=json:dumps"], "controller.reward.fn: reward function json:dumps(obj"),
        ("check_reward", ["controller.reward.fn=exact_mtch"], "controller.reward.fn: unknown reward function"),
        (
            "check_eval",
            ["eval.sets.heldout.path=/nonexistent/heldout.jsonl"],
            "eval.sets.heldout.path: /nonexistent/heldout.jsonl: no such file",
        ),
        (
            "check_environment",
            ["environment.serve=count_env:CountEnv"],
            "environment.serve: environment 'count_env:CountEnv' cannot be imported: no module named 'count_env' on "
            "PYTHONPATH",
        ),
        (
            "check_environment",
            [f"environment.servers=[127.0.0.1:{nobody}]"],
            f"environment.servers: [0] 127.0.0.1:{nobody}: no server listens there",
        ),
        ("check_engine", ["rollout.engine=sglang"], "rollout.engine: sglang is not installed: pip install"),
        (
            "check_engine",
            [f"scorers.j.model={tiny_model_dir}", "scorers.j.kind=judge", "scorers.j.engine=vllm"],
            "scorers.j.engine: vllm is not installed: pip install",
        ),
        ("check_port", [f"controller.port={busy_port}"], f"controller.port: 127.0.0.1:{busy_port} is in use"),
        (
            "check_tls",
            [f"security.tls_cert={tmp_path / 'cert.pem'}", f"security.tls_key={tmp_path / 'key.pem'}"],
            f"security.tls_cert: {tmp_path / 'cert.pem'}: cannot read (No such file or directory)",
        ),
        (
            "check_registry_names",
            ["algorithm.advantage=gea"],
            "algorithm.advantage: unknown advantage estimator 'gea'; known: ",
        ),
        ("check_registry_names", ["algorithm.policy_loss=ppo_clp"], "algorithm.policy_loss: unknown policy loss"),
        ("check_tokenizer", [f"model.path={bad_tokenizer}"], f"model.path: the tokenizer in {bad_tokenizer} does not"),
        (
            "check_tokenizer",
            ["data.system_prompt=Be brief."],
            "data.system_prompt: a system turn needs a chat template",
        ),
        (
            "check_attention",
            [f"model.path={gemma2}", "model.attn_implementation=sdpa"],
            "model.attn_implementation=sdpa: Gemma2ForCausalLM does not support an attention implementation through",
        ),
        (
            "check_routing_replay",
            ["algorithm.routing_replay=true"],
            "algorithm.routing_replay: model_type 'qwen2' has no mixture-of-experts router (a dense model)",
        ),
    ]
    assert {case[0] for case in cases} == {check.__name__ for check in (*CHECKS, *HEAVY_CHECKS)}
    runs = tmp_path / "runs"

    heavy = {check.__name__ for check in HEAVY_CHECKS}
    with_forks = HEAVY_CHECKS[0].__name__  # the one heavy `up` refusal that starts its fork server

    def refused(numbered: tuple[int, tuple[str, tuple[str, list[str], str]]]) -> tuple[str, str]:
        number, (command, (check, sets, expected)) = numbered
        # a runs directory each: `up`s refused at once would otherwise race over making and removing a shared one
        # (each removes it only when it made it), and two `up` of one name are the run lock's refusal
        sets = [f"run.dir={runs}-{number}", f"model.path={tiny_model_dir}", *sets]
        run = relayrl
        if command == "up" and check == with_forks:  # has started its fork server (and kills it): a process
            run = relayrl_process
        elif command == "up" and check in heavy:  # the same checks without a fork server: in this process
            sets.append("supervisor.fork_roles=false")
        return run(command, str(DEMO), *(arg for s in sets for arg in ("--set", s)), cwd=tmp_path), expected

    first_of_each = list({case[0]: case for case in reversed(cases)}.values())
    runs_of = list(enumerate([("check", case) for case in cases] + [("up", case) for case in first_of_each]))
    processes = [run for run in runs_of if run[1][0] == "up" and run[1][1][0] == with_forks]
    with ThreadPoolExecutor(len(processes)) as pool:  # side by side with the others, in this process
        refused_processes = pool.map(refused, processes)
        for line, expected in [*map(refused, [run for run in runs_of if run not in processes]), *refused_processes]:
            assert expected in line, line
    assert not list(tmp_path.glob("runs*"))
    code, stdout, stderr = relayrl_run("check", str(DEMO), "--set", f"run.dir={runs}")
    assert code == 0 and "ok" in stdout and not runs.exists(), stderr


def test_a_hub_model_id_that_does_not_resolve_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    """A hub id that is in no local cache: with HF_HUB_OFFLINE `check` and `up` say the hub is offline, and with a
    hub that cannot be reached (HF_ENDPOINT on a port nobody listens on) they say so; exit 2, no run directory. The
    test never touches the network."""
    runs = tmp_path / "runs"
    sets = ["--set", f"run.dir={runs}", "--set", "model.path=no-such-org/no-such-model"]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody = closed.getsockname()[1]
    cache = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    offline = {**cache, "HF_HUB_OFFLINE": "1"}
    unreachable = {**cache, "HF_HUB_OFFLINE": "", "HF_ENDPOINT": f"http://127.0.0.1:{nobody}"}
    for command in ("check", "up"):  # processes: huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT at import
        line = relayrl_process(command, str(DEMO), *sets, cwd=tmp_path, env=offline)
        assert line.startswith("relayrl: config error: model.path: no-such-org/no-such-model: not in the local hub")
        assert "the hub is offline (HF_HUB_OFFLINE)" in line, line
        line = relayrl_process(command, str(DEMO), *sets, cwd=tmp_path, env=unreachable)
        assert f"the hub (http://127.0.0.1:{nobody}) cannot be reached" in line and "looks offline" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# Combinations of features the config refuses (tests/unit/test_combinations.py has them all): the --set of each,
# and the two keys its line names (the demo sets loss_agg token-mean, which gspo refuses on its own)
GSPO = ["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-mean"]
REFUSED_COMBINATIONS = [
    ([*GSPO, "algorithm.old_logprobs=rollout"], "algorithm.old_logprobs", "algorithm.policy_loss"),
    ([*GSPO, "trainer.stream=on"], "trainer.stream", "algorithm.policy_loss"),
    (["algorithm.advantage=reinforce_pp", "trainer.stream=on"], "trainer.stream", "algorithm.advantage"),
    (["algorithm.advantage=gae", "model.lora.rank=4"], "model.lora", "algorithm.advantage"),
    (["algorithm.advantage=gae", "trainer.backend=megatron"], "trainer.backend", "algorithm.advantage"),
    (["critic.warmup_steps=1"], "critic.warmup_steps", "algorithm.advantage"),
    (["algorithm.routing_replay=true", "trainer.backend=megatron"], "algorithm.routing_replay", "trainer.backend"),
]


def test_check_refuses_each_impossible_combination_as_up_does(tmp_path: Path) -> None:
    """`relayrl check` and `relayrl up` on a combination of features that cannot train together: both exit 2 with
    the same one line, naming both keys; nothing is written."""

    def line(numbered: tuple[int, tuple[str, list[str]]]) -> str:
        number, (command, sets) = numbered
        sets = [f"run.dir={tmp_path / f'runs-{number}'}", *sets]
        return relayrl(command, str(DEMO), *(arg for s in sets for arg in ("--set", s)), cwd=tmp_path)

    runs = [(command, sets) for sets, _, _ in REFUSED_COMBINATIONS for command in ("check", "up")]
    lines = list(map(line, enumerate(runs)))
    for (_, first, second), check, up in zip(REFUSED_COMBINATIONS, lines[::2], lines[1::2], strict=True):
        assert check == up and check.startswith("relayrl: config error: "), (check, up)
        assert first in check and second in check, check
    assert not list(tmp_path.glob("runs*"))


def test_ctrl_c_early_in_start_up_exits_130_in_one_line_and_leaves_no_run_directory(tmp_path: Path) -> None:
    """Ctrl-C the moment the run directory exists (the demo's assets are being built, no role has started): the
    launcher says so in a line, exits 130 (128 + SIGINT), and removes the directory it had just made."""
    runs = tmp_path / "runs"
    up = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "up", str(DEMO), "--set", f"run.dir={runs}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"},  # rich wraps a long run path's line
    )
    try:
        while not (runs / "digits").exists() and up.poll() is None:
            time.sleep(0.02)
        up.send_signal(signal.SIGINT)
        _, stderr = up.communicate(timeout=120)
    finally:
        up.kill()
    assert up.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "SIGINT: stopping every process" in stderr and "stopped before the run started" in stderr
    assert not runs.exists()  # the run directory, the run lock and the runs directory this up made


def test_a_role_that_dies_at_start_has_its_error_on_the_console(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Weights that do not load pass the start-up checks (the tokenizer loads): the worker dies loading them, and
    `relayrl up` says what it died of, not only where its log is."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(b"not safetensors")
    sets = [f"run.dir={tmp_path / 'runs'}", f"model.path={model}"]
    done = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "up", str(DEMO), *(arg for s in sets for arg in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "1000"},
    )
    assert done.returncode == 1, done.stderr[-3000:]
    failed = next(line for line in done.stderr.splitlines() if "relayrl up failed" in line)
    assert "exited with code" in failed and "SafetensorError" in failed and ".log)" in failed, failed


def test_a_busy_port_is_one_line_before_anything_is_built(tmp_path: Path, busy_port: int) -> None:
    sets = ["--set", f"run.dir={tmp_path / 'runs'}"]
    cases = [
        (["controller", "serve", "--config", str(DEMO), "--port", str(busy_port), *sets], "--port"),
        (
            ["controller", "serve", "--config", str(DEMO), "--set", f"controller.port={busy_port}", *sets],
            "controller.port",
        ),
        (["rollout", "serve", "--config", str(DEMO), "--port", str(busy_port), *sets], "--port"),
        (["rollout", "serve", "--config", str(DEMO), "--metrics-port", str(busy_port), *sets], "--metrics-port"),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:  # role commands: each a process of its own (ROLES)
        lines = list(pool.map(lambda case: relayrl_process(*case[0], cwd=tmp_path), cases))
    for (_, flag), line in zip(cases, lines, strict=True):
        host = "0.0.0.0" if flag == "--metrics-port" else "127.0.0.1"  # the metrics endpoint binds every address
        assert f"{flag}: {host}:{busy_port} is in use" in line, line
    assert not any(tmp_path.iterdir())


def test_a_metrics_port_taken_after_the_start_up_check_is_the_same_one_line(busy_port: int) -> None:
    """The endpoint binds after the model is loaded: a port taken meanwhile is a ConfigError naming the flag."""
    from prometheus_client.registry import Collector

    from relayrl.config import ConfigError
    from relayrl.services.metrics import MetricsEndpoint

    class Nothing(Collector):
        def collect(self):
            return iter(())

    with pytest.raises(ConfigError, match=rf"--metrics-port: 0\.0\.0\.0:{busy_port} is in use \(Address already"):
        MetricsEndpoint(busy_port).start(Nothing())


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("localhost", "'localhost' has no port"),
        ("127.0.0.1:99999", "port 99999 is out of range 1..65535"),
        ("127.0.0.1:0", "port 0 is out of range 1..65535"),
        ("http://127.0.0.1:50051", "has a scheme (http://)"),
        ("grpc://h:1", "has a scheme (grpc://)"),
        (":50051", "has no valid host"),
        ("h:x", "port 'x' is not a number"),
        ("[::1", "is not [ipv6]:port"),
    ],
)
def test_an_address_is_host_and_port_strictly(text: str, reason: str) -> None:
    from relayrl.runtime.address import AddressError, parse_address

    with pytest.raises(AddressError, match=re.escape(f"--controller: {text!r}" if "port" not in reason else reason)):
        parse_address(text, "--controller")
    assert (
        str(parse_address(" h.example:443 ", "x")) == "h.example:443"
        and str(parse_address("[::1]:5", "x")) == "[::1]:5"
    )


def test_config_keys_holding_a_host_or_address_are_checked_at_load() -> None:
    from relayrl.config import ConfigError

    for assignment, message in [
        ("controller.host=http://h", "controller.host: 'http://h' has a scheme"),
        ("weight_sync.master_address=h:29500", "weight_sync.master_address: 'h:29500' is not a host name"),
        ("environment.servers=[a:1, localhost]", "environment.servers: [1]: 'localhost' has no port"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(DEMO, [assignment])


def test_check_refuses_a_rollout_correction_threshold_that_cannot_hold_naming_the_key(tmp_path: Path) -> None:
    """lower > upper, a bound <= 0, ratio bounds that on-policy data fails (1 outside them), a lower bound on a
    divergence: each one line naming the key, before anything starts."""
    key = "algorithm.rollout_correction"
    cases = [
        ([f"{key}.rollout_is=token", f'{key}.rollout_is_threshold="5.0_0.5"'], "the lower bound 5.0 is above"),
        ([f"{key}.rollout_is_threshold=[0.5, 0]"], "every bound must be a finite number > 0"),
        ([f"{key}.rollout_rs=seq_mean_k1", f'{key}.rollout_rs_threshold="1.1_2"'], "ratio bounds must hold 1"),
        ([f"{key}.rollout_rs=token_k1,token_k3", f'{key}.rollout_rs_threshold="0.5_2,-1"'], "> 0"),
        ([f"{key}.rollout_rs=token_k3", f'{key}.rollout_rs_threshold="0.1_0.2"'], "expected one upper bound"),
    ]

    def refused(sets: list[str]) -> str:
        argv = ["check", str(DEMO), *(arg for s in sets for arg in ("--set", s))]
        return relayrl(*argv, cwd=tmp_path, env=NO_ADDRESS)

    lines = [refused(sets) for sets, _ in cases]
    for (sets, reason), line in zip(cases, lines, strict=True):
        named = "rollout_is_threshold" if "rollout_is_threshold" in sets[-1] else "rollout_rs_threshold"
        assert f"{key}.{named}" in line and reason in line, (sets, line)
    assert not any(tmp_path.iterdir())
