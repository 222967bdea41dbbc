"""Agentic episodes under ``relayrl up`` against two environment servers at once: the Python GuessNumber that
``environment.serve`` starts, and a Node.js server written from the .proto alone (tests/node/guess_env.js), named
in ``environment.servers``. Mid-run the Python server is killed -9 while it holds sessions (episodes between
their Reset and Close: mostly waiting for a turn to be generated): the run completes, the episodes it held end
``failed`` with the reason, their groups are not trained, nothing is lost or trained twice, the supervisor
restarts the server, and the Node server's episodes were trained."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from relayrl.config import load_config
from relayrl.env import EnvironmentClient
from relayrl.models.tiny_chat import write_tiny_chat_model

from .jobs import contiguous_records, finish, ledger_fates, running_up, supervised_roles, wait_until
from .test_node import NODE_DIR, node  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("chat") / "tiny-chat", seed=0, pretrain=False)


def node_server(node_bin: str, log: Path) -> tuple[subprocess.Popen, str]:
    """tests/node/guess_env.js on a free port, its stdout in ``log``; returns the process and its address."""
    proc = subprocess.Popen([node_bin, str(NODE_DIR / "guess_env.js"), "0", "16"], stdout=log.open("w"), text=True)
    wait_until(lambda: "listening on" in log.read_text(), 60, "the node server")
    return proc, log.read_text().splitlines()[0].removeprefix("listening on ")


def ledger_events(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.run_dir / "controller" / "ledger.jsonl").read_text().splitlines()]


def test_up_runs_episodes_on_a_node_server_and_survives_an_environment_server_killed_mid_run(
    node,  # noqa: F811  (the fixture imported above)
    chat_model,
    make_config,
    tmp_path,
) -> None:
    node_proc, node_address = node_server(node, tmp_path / "node.log")
    data = tmp_path / "guess.jsonl"
    data.write_text("".join(json.dumps({"prompt": "guess", "answer": ""}) + "\n" for _ in range(64)))
    config = make_config(
        "env-faults",
        model={"path": str(chat_model)},
        data={"path": str(data)},
        rollout={"workers": 1, "n": 4, "max_tokens": 8},
        controller={"prompts_per_gen_batch": 4, "train_batch_groups": 2, "dynamic_sampling": False},
        trainer={"steps": STEPS, "nproc": 1, "mini_batches": 1},
        environment={
            "serve": "relayrl.env.examples.guess:GuessNumber",
            "replicas": 1,
            "servers": [node_address],
            "max_sessions": 16,
            "max_turns": 3,
            "max_total_tokens": 480,
        },
        supervisor={"backoff_s": 0.5},
    )
    cfg = load_config(config)
    try:
        with running_up(config) as up:
            wait_until(lambda: "env-0" in supervised_roles(cfg), 120, "the environment server role")
            python_env = load_config(cfg.run_dir / "config.yaml").environment.servers[-1]
            client = EnvironmentClient(python_env, timeout_s=10)
            wait_until(lambda: client.info()["sessions"] > 0, 300, "episodes in flight on the Python server")
            os.kill(supervised_roles(cfg)["env-0"]["pid"], signal.SIGKILL)
            code, err = finish(up)
        assert code == 0, err
    finally:
        node_proc.terminate()
        node_proc.wait(timeout=10)

    records = contiguous_records(cfg, STEPS)  # the run completed every step
    assert supervised_roles(cfg)["env-0"]["restarts"] == 1
    fates = ledger_fates(cfg)
    assert not [pid for pid, f in fates.items() if f[-1] not in {"trained", "filtered", "failed"}]  # nothing lost
    assert not [pid for pid, f in fates.items() if f.count("trained") > 1]  # nothing trained twice
    events = ledger_events(cfg)
    failed = {e["id"]: e["reason"] for e in events if e.get("state") == "failed"}
    killed = {pid: why for pid, why in failed.items() if "environment error" in why}
    assert killed, f"no episode failed with the killed server's error: {failed}"
    assert all(fates[pid][-1] == "failed" for pid in killed)  # a group with a failed episode is not trained
    notes = [n for e in events if e.get("episodes") for n in e["episodes"] if n.startswith("failed: environment")]
    assert notes, "the ledger's episode notes name the failed episodes' reason"
    assert sum(r.get("episode_end/failed", 0) for r in records) >= len(killed)

    node_sessions = [line.removeprefix("closed ") for line in (tmp_path / "node.log").read_text().splitlines()[1:]]
    node_prompts = {session.split("/")[0] for session in node_sessions}
    assert any(fates.get(pid, [""])[-1] == "trained" for pid in node_prompts), (node_prompts, fates)
    print(json.dumps({"killed_episodes_failed": len(killed), "node_episodes": len(node_sessions)}))
