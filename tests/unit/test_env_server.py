"""``EnvironmentServer`` over real gRPC: an episode, statuses, deadlines, health, reflection, the token."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from relayrl.config import SecurityConfig
from relayrl.env import EnvError, EnvironmentClient
from relayrl.env.server import EnvironmentServer
from relayrl.rpc.auth import ClientSecurity
from relayrl.v1 import environment_pb2 as pb
from relayrl.v1 import environment_pb2_grpc as pb_grpc
from tests.unit.test_env_sessions import SAY, AsyncCounter, Counter

TOKEN = "t0k3n-for-the-environment-tests"


@pytest.fixture
def served():
    servers = []

    def serve(env_class=Counter, **kwargs) -> EnvironmentServer:
        servers.append(EnvironmentServer(env_class, **kwargs).start())
        return servers[-1]

    yield serve
    for server in servers:
        server.stop(grace_s=0)


def test_an_episode_over_grpc_and_the_server_outlives_a_broken_step(served) -> None:
    server = served(max_sessions=1)
    env = EnvironmentClient(server.address, timeout_s=10, security=ClientSecurity())
    assert env.info() == {"name": "Counter", "max_sessions": 1, "sessions": 0}
    env.reset("s", {"turns": 2}, seed=3)
    with pytest.raises(EnvError) as err:
        env.reset("t", {}, seed=3)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(EnvError) as err:
        env.step("s", {"role": "assistant", "content": "boom"})
    assert err.value.code == grpc.StatusCode.INTERNAL and "ValueError: the environment broke" in err.value.reason
    assert env.step("s", SAY).done is False
    last = env.step("s", SAY)
    assert (last.done, last.reward) == (True, 2.0)
    assert env.close("s") is None
    with pytest.raises(EnvError) as err:
        env.step("s", SAY)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    env.disconnect()


def test_the_grpc_deadline_is_the_environment_deadline(served) -> None:
    server = served(AsyncCounter)
    env = EnvironmentClient(server.address, timeout_s=0.5, security=ClientSecurity())
    env.reset("s", {}, 0)
    with pytest.raises(EnvError) as err:
        env.step("s", {"role": "assistant", "content": "hang"})
    assert err.value.deadline
    assert env.close("s", "deadline") == 0.5


def test_health_reflection_and_bad_bytes(served) -> None:
    server = served()
    channel = grpc.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="relayrl.v1.EnvironmentService"), timeout=5)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "relayrl.v1.EnvironmentService" in {s.name for s in answer.list_services_response.service}
    garbage = channel.unary_unary("/relayrl.v1.EnvironmentService/Reset")
    with pytest.raises(grpc.RpcError) as err:
        garbage(b"\xff\xff\xff", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_token_guards_every_call(served, monkeypatch) -> None:
    monkeypatch.setenv("RELAYRL_AUTH_TOKEN", TOKEN)
    server = served(security=SecurityConfig())
    with pytest.raises(EnvError) as err:
        EnvironmentClient(server.address, timeout_s=5, security=ClientSecurity()).info()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert EnvironmentClient(server.address, timeout_s=5, security=SecurityConfig()).info()["name"] == "Counter"


def test_a_busy_port_is_refused(served) -> None:
    server = served()
    with pytest.raises(OSError, match="cannot bind"):
        EnvironmentServer(Counter, port=server.port)


def test_a_cancelled_call_cancels_the_async_environment_method(served) -> None:
    server = served(AsyncCounter)
    env = EnvironmentClient(server.address, timeout_s=10, security=ClientSecurity())
    env.reset("s", {}, 0)
    stub = pb_grpc.EnvironmentServiceStub(grpc.insecure_channel(server.address))
    hanging = stub.Step.future(
        pb.StepRequest(session_id="s", action=pb.ChatMessage(role="assistant", content="hang")), timeout=3600
    )
    deadline = time.monotonic() + 10
    while server.table.info().sessions and not server.table._sessions["s"].busy.locked():
        assert time.monotonic() < deadline, "the step never started"
        time.sleep(0.01)
    hanging.cancel()
    while True:  # the session frees once the coroutine is cancelled (it would hang for an hour otherwise)
        try:
            assert env.step("s", SAY).observations[0]["content"] == "1"
            break
        except EnvError as err:
            assert err.code == grpc.StatusCode.FAILED_PRECONDITION
            assert time.monotonic() < deadline, "the cancelled step still holds the session"
            time.sleep(0.05)
