"""Clients and servers in another language, written from the .proto files alone (Node.js, @grpc/grpc-js):
an EnvironmentService server that runs episodes through ``EnvironmentClient``, and a SubmitPrompts client that
omits sampling fields against a real controller and rollout worker (issue #27 item 8); a ScorerService client
(issue 46, item 1)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from relayrl.config import parse_config
from relayrl.env import EnvError, EnvironmentClient
from relayrl.services.controller_server import serve_controller
from relayrl.services.rollout_server import serve_rollout
from tests.integration.test_env_serve import read_lines

NODE_DIR = Path(__file__).resolve().parents[1] / "node"


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with tests/node's packages installed (npm install when node_modules is missing)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed: the Node.js tests need both (apt-get install nodejs npm)")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        subprocess.run([npm, "install", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=600)
    return node


@pytest.fixture
def node_env(node):
    proc = subprocess.Popen([node, str(NODE_DIR / "guess_env.js"), "0", "2"], stdout=subprocess.PIPE, text=True)
    try:
        (line,) = read_lines(proc, 1)
        yield line.removeprefix("listening on ")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def text(content: str) -> dict:
    return {"role": "assistant", "content": content}


def guess(number: int, call_id: str) -> dict:
    function = {"name": "guess", "arguments": {"number": number}}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def test_a_node_environment_runs_episodes_through_environment_client(node_env: str) -> None:
    env = EnvironmentClient(node_env, timeout_s=10)
    assert env.info() == {"name": "guess-number-node", "max_sessions": 2, "sessions": 0}
    opening = env.reset("tools", {"secret": 6}, seed=1)
    assert [m["role"] for m in opening.messages] == ["system", "user"]
    assert opening.tools[0]["function"]["parameters"]["required"] == ["number"]  # JSON schema text -> dict

    first = env.step("tools", guess(4, "call_0"))
    assert first.observations == [{"role": "tool", "content": "higher", "tool_call_id": "call_0", "name": "guess"}]
    assert (first.reward, first.done, first.truncated, first.metrics) == (None, False, False, {"solved": 0.0})
    second = env.step("tools", guess(7, "call_1"))
    assert second.observations[0]["content"] == "lower" and not second.done
    last = env.step("tools", guess(6, "call_2"))
    assert (last.observations[0]["content"], last.reward, last.done) == ("correct", 1.0, True)
    assert env.close("tools") == 0.0

    env.reset("text", {}, seed=12345)
    same_seed = EnvironmentClient(node_env, timeout_s=10)
    same_seed.reset("text-again", {}, seed=12345)
    replies = [env.step("text", text(f"I say {k}")).observations[0]["content"] for k in (1, 8)]
    assert replies == [same_seed.step("text-again", text(f"{k}")).observations[0]["content"] for k in (1, 8)]
    with pytest.raises(EnvError) as err:
        env.reset("third", {}, seed=0)  # max sessions 2
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(EnvError) as err:
        env.reset("text", {}, seed=0)
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert env.close("text", "max_turns") == 0.0 and same_seed.close("text-again", "aborted") == 0.0
    with pytest.raises(EnvError) as err:
        env.step("text", text("3"))
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert env.close("text") is None  # idempotent: unknown session, no reward


@pytest.fixture(scope="module")
def controller(tmp_path_factory, tiny_model_dir, digits_path):
    root = tmp_path_factory.mktemp("node")
    cfg = parse_config(
        {
            "run": {"name": "node", "dir": str(root / "runs")},
            "model": {"path": str(tiny_model_dir)},
            "data": {"path": str(digits_path)},
            "rollout": {"workers": 1},
        }
    )
    server, ctl = serve_controller(cfg, port=0)
    address = f"127.0.0.1:{server.port}"
    worker = serve_rollout(cfg, controller=address, host="127.0.0.1", port=0, advertise=None, worker_id="w0")
    deadline = time.monotonic() + 60
    while not ctl.registry.snapshot():
        assert time.monotonic() < deadline, "the worker did not register"
        time.sleep(0.1)
    yield address
    worker[2].stop(deregister=True)
    worker[0].stop(grace_s=0)
    server.stop(grace_s=0)
    ctl.stop()


def test_a_node_submit_prompts_that_omits_sampling_fields_gets_the_defaults(node: str, controller: str) -> None:
    """params carries max_tokens only: n 1, temperature 1.0, top_p 1.0 on the controller (before #27: refused,
    "params.n: must be >= 1")."""
    result = subprocess.run(
        [node, str(NODE_DIR / "submit_defaults.js"), controller], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    completions = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(completions) == 2  # two prompts, n omitted -> 1 each
    assert {c["sample_index"] for c in completions} == {0}
    assert all(1 <= c["tokens"] <= 2 for c in completions)


def test_a_node_client_scores_conversations_from_the_scorer_proto_alone(node: str, tmp_path) -> None:
    """Score from scorer.proto with @grpc/proto-loader: the scores Python's client gets for the same conversations,
    and an empty request answered INVALID_ARGUMENT naming ``items``."""
    from relayrl.rewards.served import ScorerClient
    from relayrl.services.scorer_server import serve_scorer
    from tests.unit.scorer_testing import write_tiny_reward_model

    scorer = {"model": str(write_tiny_reward_model(tmp_path / "rm")), "precision": "float32", "replicas": 1}
    cfg = parse_config({"model": {"path": "m"}, "data": {"path": "d"}, "scorers": {"rm": scorer}})
    server, worker = serve_scorer(cfg, "rm", host="127.0.0.1", port=0)
    address = f"127.0.0.1:{server.port}"
    try:
        argv = [node, str(NODE_DIR / "score.js"), address]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        chats = [[{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": r}] for r in ("5", "6")]
        python = ScorerClient("rm", cfg.scorers["rm"].model_copy(update={"servers": [address]})).score(chats)
        assert answer["scores"] == pytest.approx(python, abs=1e-6)
        assert answer["refused"].startswith("INVALID_ARGUMENT: items:"), answer
    finally:
        server.stop(grace_s=0)
        worker.stop()
