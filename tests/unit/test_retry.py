"""The one retry policy (relayrl/rpc/retry.py), as the SDK (sync and asyncio) and the roles' calls apply it:
exactly UNAVAILABLE and DEADLINE_EXCEEDED are tried again, every other code is raised after one try."""

from __future__ import annotations

import asyncio
from concurrent import futures
from functools import partial

import grpc
import pytest

from relayrl.client import AsyncRelayClient, RelayClient
from relayrl.rpc.retry import RETRYABLE, RetryPolicy, call_with_retry
from relayrl.v1 import controller_pb2, controller_pb2_grpc

CODES = [code for code in grpc.StatusCode if code != grpc.StatusCode.OK]


class FailsOnce(controller_pb2_grpc.ControllerServiceServicer):
    """Status fails with ``code`` on its first call, then answers."""

    def __init__(self) -> None:
        self.code = grpc.StatusCode.UNAVAILABLE
        self.calls = 0

    def Status(self, request, context):
        self.calls += 1
        if self.calls == 1:
            context.abort(self.code, "scripted failure")
        return controller_pb2.StatusResponse(run_name="answered")


@pytest.fixture(scope="module")
def server():
    servicer = FailsOnce()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield servicer, f"127.0.0.1:{port}"
    grpc_server.stop(0)


def sdk_sync(address: str):
    with RelayClient(address, attempts=3, backoff_s=0.01) as client:
        return client.status(timeout=10)


def sdk_async(address: str):
    async def status():
        async with AsyncRelayClient(address, attempts=3, backoff_s=0.01) as client:
            return await client.status(timeout=10)

    return asyncio.run(status())


def services(address: str):
    with grpc.insecure_channel(address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        return call_with_retry(partial(stub.Status, controller_pb2.StatusRequest(), timeout=10), what="", deadline_s=10)


@pytest.mark.parametrize("caller", [sdk_sync, sdk_async, services], ids=lambda f: f.__name__)
def test_exactly_unavailable_and_deadline_exceeded_are_retried_by_every_caller(server, caller):
    servicer, address = server
    retried = set()
    for code in CODES:
        servicer.code, servicer.calls = code, 0
        try:
            assert caller(address).run_name == "answered"
            retried.add(code)
        except grpc.RpcError as err:
            assert err.code() == code, (code, err)
        assert servicer.calls == (2 if code in retried else 1), code
    assert retried == RETRYABLE == {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def test_waits_double_up_to_the_cap_within_the_jitter_and_stop_after_the_attempts():
    waits = list(RetryPolicy(backoff_s=0.5, max_backoff_s=3.0, attempts=6, jitter=0.2).waits())
    assert len(waits) == 5
    for wait, base in zip(waits, [0.5, 1.0, 2.0, 3.0, 3.0]):
        assert 0.8 * base <= wait <= 1.2 * base
    assert list(RetryPolicy(backoff_s=0.5, max_backoff_s=3.0, attempts=4).waits()) == [0.5, 1.0, 2.0]
