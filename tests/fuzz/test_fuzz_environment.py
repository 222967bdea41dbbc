"""Property: every malformed or out-of-order request to an environment server (``relayrl env serve``, a real
process, serving GuessNumber with room for two sessions) is answered with a precise status before its deadline,
never INTERNAL / UNKNOWN, and the server plays a correct episode afterwards. Requests: near-valid calls on a few
shared session ids (so Reset, Step and Close meet each other's sessions), any message of a method's type with
hostile field values, and raw bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relayrl.env import EnvironmentClient
from relayrl.rpc.channels import open_channel
from relayrl.v1 import environment_pb2 as pb
from tests.integration.test_env_serve import read_lines

from .strategies import SHORT_TEXT, TEXT
from .test_fuzz_services import FUZZ, assert_answered, call, requests

pytestmark = pytest.mark.slow

SERVICE = pb.DESCRIPTOR.services_by_name["EnvironmentService"]
SESSIONS = st.sampled_from(["a", "a", "b", "b", "c", ""])
JSON_VALUES = st.one_of(
    st.integers(-10, 20), st.integers(), st.text(max_size=8), st.none(), st.booleans(), st.floats(allow_nan=False)
)
VALID_TASKS = st.fixed_dictionaries({}, optional={"secret": st.integers(1, 8), "max_turns": st.integers(1, 3)})
TASKS = st.one_of(
    VALID_TASKS.map(json.dumps),
    VALID_TASKS.map(json.dumps),
    st.fixed_dictionaries({}, optional={"secret": JSON_VALUES, "max_turns": JSON_VALUES}).map(json.dumps),
    st.sampled_from(["", "{", "[]", "3", '"x"', "null", '{"secret": 1e400}']),
    TEXT,
)
ARGUMENTS = st.one_of(
    st.fixed_dictionaries({"number": st.integers(0, 9)}).map(json.dumps),
    st.fixed_dictionaries({}, optional={"number": JSON_VALUES}).map(json.dumps),
    st.sampled_from(["", "{", "[]", '{"number": "7"}', '{"number": "' + "9" * 5000 + '"}']),
    SHORT_TEXT,
)
CONTENT = st.one_of(TEXT, st.sampled_from(["4", "-3", "9" * 5000, "guess 12 or 2", "\x00"]))


def near_valid() -> st.SearchStrategy:
    call = st.builds(
        pb.ToolCall, id=SHORT_TEXT, name=st.sampled_from(["guess", "guess", "", "peek"]), arguments=ARGUMENTS
    )
    action = st.builds(
        pb.ChatMessage,
        role=st.sampled_from(["assistant", "assistant", "assistant", "user", ""]),
        content=CONTENT,
        tool_calls=st.one_of(st.just([]), st.lists(call, max_size=2)),
        tool_call_id=SHORT_TEXT,
    )
    return st.one_of(
        st.tuples(
            st.just("Reset"),
            st.builds(
                pb.ResetRequest,
                session_id=SESSIONS,
                task=TASKS,
                seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
            ),
        ),
        st.tuples(st.just("Step"), st.builds(pb.StepRequest, session_id=SESSIONS, action=action)),
        st.tuples(st.just("Close"), st.builds(pb.CloseRequest, session_id=SESSIONS, reason=SHORT_TEXT)),
        st.tuples(st.just("Info"), st.just(pb.InfoRequest())),
    )


@pytest.fixture(scope="module")
def server():
    argv = [sys.executable, "-m", "relayrl.cli", "env", "serve", "relayrl.env.examples.guess:GuessNumber"]
    proc = subprocess.Popen([*argv, "--max-sessions", "2"], stdout=subprocess.PIPE, text=True)
    try:
        (line,) = read_lines(proc, 1)
        yield proc, line.rpartition(" ")[2]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_environment_server_answers_every_malformed_request(server) -> None:
    proc, address = server
    channel = open_channel(address)

    opened: set[str] = set()  # sessions a fuzzed Reset opened, closed at the end to free the two slots

    @FUZZ
    @given(requests(SERVICE, near_valid()))
    def fuzz(case) -> None:
        method, request = case
        code = call(channel, SERVICE, method, request)
        assert_answered(method, code)
        if method == "Reset" and code == grpc.StatusCode.OK:
            parsed = pb.ResetRequest.FromString(request) if isinstance(request, bytes) else request
            opened.add(parsed.session_id)

    fuzz()
    assert proc.poll() is None, "the environment server exited"
    env = EnvironmentClient(address, timeout_s=10)
    for session in opened:
        env.close(session, "aborted")
    env.reset("after", {"secret": 5}, 0)
    assert env.step("after", {"role": "assistant", "content": "5"}).reward == 1.0
    assert env.info()["sessions"] == 1
    with pytest.raises(grpc.RpcError):  # a plain stub still sees statuses, not a dead server
        channel.unary_unary(f"/{SERVICE.full_name}/Step")(b"\xff", timeout=10)
