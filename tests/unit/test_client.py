"""relayrl.client against a scripted in-process ControllerService (generated stubs only): retries on
UNAVAILABLE, deadlines, the bearer token, resumed SubmitPrompts streams, TLS, a run directory for an address; sync
and asyncio."""

from __future__ import annotations

import asyncio
import datetime
import time
from concurrent import futures

import grpc
import pytest

from relayrl.client import AsyncRelayClient, ClientConfigError, Prompt, RelayClient, SamplingParams
from relayrl.v1 import common_pb2, controller_pb2, controller_pb2_grpc

TOKEN = "s3cret-token-0123456789"


class ScriptedController(controller_pb2_grpc.ControllerServiceServicer):
    """Status fails ``fail_first`` times with UNAVAILABLE, then answers (after ``delay_s``). SubmitPrompts
    streams n samples per prompt; its first call breaks with UNAVAILABLE after ``break_after`` messages."""

    def __init__(self) -> None:
        self.fail_first = 0
        self.delay_s = 0.0
        self.break_after: int | None = None
        self.status_calls = 0
        self.submit_requests: list[controller_pb2.SubmitPromptsRequest] = []
        self.metadata: list[dict] = []

    def Status(self, request, context):
        self.status_calls += 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.status_calls <= self.fail_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        time.sleep(self.delay_s)
        return controller_pb2.StatusResponse(run_name="scripted", workers=[controller_pb2.WorkerStatus(worker_id="w0")])

    def DrainWorker(self, request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id: no registered worker {request.worker_id!r}")

    def SubmitPrompts(self, request, context):
        self.submit_requests.append(request)
        sent = 0
        for prompt in request.prompts:
            for k in range(request.params.n):
                if self.break_after is not None and sent == self.break_after and len(self.submit_requests) == 1:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost")
                completion = common_pb2.Completion(
                    prompt_id=prompt.prompt_id,
                    sample_index=k,
                    token_ids=[1, 2, 3],
                    logprobs=[-0.5, -0.25, -0.125],
                    finish_reason=common_pb2.FINISH_REASON_STOP,
                    policy_version=7,
                    worker_id="w0",
                    text=f"answer {k}",
                )
                yield controller_pb2.SubmittedCompletion(completion=completion, reward=1.0)
                sent += 1


@pytest.fixture
def scripted():
    servicer = ScriptedController()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_unavailable_is_retried_with_backoff(scripted):
    servicer, address = scripted
    servicer.fail_first = 2
    with RelayClient(address, attempts=3, backoff_s=0.05) as client:
        assert client.status().run_name == "scripted"
    assert servicer.status_calls == 3


def test_retries_stop_after_the_configured_attempts(scripted):
    servicer, address = scripted
    servicer.fail_first = 100
    with RelayClient(address, attempts=3, backoff_s=0.01) as client, pytest.raises(grpc.RpcError) as err:
        client.status()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert servicer.status_calls == 3


def test_other_errors_are_not_retried(scripted):
    _, address = scripted
    with RelayClient(address, attempts=5) as client, pytest.raises(grpc.RpcError) as err:
        client.drain("nobody")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "worker_id" in err.value.details()


def test_the_deadline_covers_the_call_and_its_retries(scripted):
    servicer, address = scripted
    servicer.delay_s = 2.0
    with RelayClient(address) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.status(timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 1.5
    servicer.delay_s, servicer.fail_first = 0.0, 10_000
    with RelayClient(address, attempts=1000, backoff_s=0.05, max_backoff_s=0.1) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError):
            client.status(timeout=1.0)
        assert 0.8 < time.monotonic() - started < 2.0


def test_unreachable_controller_is_unavailable_after_the_attempts():
    from relayrl.runtime.ports import free_port

    with (
        RelayClient(f"127.0.0.1:{free_port()}", attempts=2, backoff_s=0.01) as client,
        pytest.raises(grpc.RpcError) as err,
    ):
        client.status(timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_token_goes_out_as_bearer_metadata_and_never_into_repr(scripted, monkeypatch):
    servicer, address = scripted
    monkeypatch.setenv("RELAYRL_CONTROLLER", address)
    monkeypatch.setenv("RELAYRL_AUTH_TOKEN", TOKEN)
    with RelayClient() as client:  # address and token from the environment
        client.status()
        assert TOKEN not in repr(client.options)
    assert servicer.metadata[-1]["authorization"] == f"Bearer {TOKEN}"
    with RelayClient(address, token="another-token-abcdefgh") as client:  # the argument wins
        client.status()
    assert servicer.metadata[-1]["authorization"] == "Bearer another-token-abcdefgh"


def test_a_run_directory_is_an_address_both_clients_take(scripted, tmp_path, monkeypatch):
    """``RelayClient("runs/NAME")``: the address ``relayrl up`` recorded there; a directory without one is refused
    naming it (the environment's address is not taken instead)."""
    _, address = scripted
    run = tmp_path / "runs" / "mine"
    run.mkdir(parents=True)
    (run / "controller.address").write_text(address)  # as relayrl up writes it
    with RelayClient(run) as client:
        assert client.status().run_name == "scripted" and client.options.address == address

    async def scenario():
        async with AsyncRelayClient(str(run)) as client:
            return await client.status()

    assert asyncio.run(scenario()).run_name == "scripted"
    monkeypatch.setenv("RELAYRL_CONTROLLER", address)
    with pytest.raises(ClientConfigError, match=f"address: {tmp_path} has no controller.address"):
        RelayClient(tmp_path)


def test_missing_address_names_the_variable(monkeypatch):
    monkeypatch.delenv("RELAYRL_CONTROLLER", raising=False)
    with pytest.raises(ClientConfigError, match="RELAYRL_CONTROLLER"):
        RelayClient()


def test_submit_resumes_a_broken_stream_without_duplicates(scripted):
    servicer, address = scripted
    servicer.break_after = 3  # prompt a: 3 of 4 samples arrive, then UNAVAILABLE
    prompts = [Prompt(text="a", prompt_id="a", answer="1"), {"prompt": "b", "id": "b"}, "c"]
    with RelayClient(address, backoff_s=0.01) as client:
        results = list(client.submit(prompts, SamplingParams(n=4, max_tokens=3), reward_fn="exact_match"))
    per_prompt = {}
    for c in results:
        per_prompt.setdefault(c.prompt_id, set()).add(c.sample_index)
    assert len(results) == 12 and all(indices == {0, 1, 2, 3} for indices in per_prompt.values())
    assert {c.policy_version for c in results} == {7} and all(c.reward == 1.0 for c in results)
    assert results[0].token_ids == [1, 2, 3] and results[0].logprobs == [-0.5, -0.25, -0.125]
    assert results[0].finish_reason == "stop" and results[0].text == "answer 0"
    first, second = servicer.submit_requests
    assert [p.prompt_id for p in first.prompts][:2] == ["a", "b"] and first.reward_fn == "exact_match"
    assert [p.prompt_id for p in second.prompts][:2] == ["a", "b"]  # a was incomplete: asked again
    assert len(second.prompts) == 3 and second.params.n == 4


def test_async_client_retries_resumes_and_honours_deadlines(scripted):
    servicer, address = scripted

    async def scenario():
        servicer.fail_first = 2
        async with AsyncRelayClient(address, attempts=3, backoff_s=0.05) as client:
            status = await client.status()
            servicer.break_after = 1
            results = [c async for c in client.submit(["x", "y"], SamplingParams(n=2))]
            servicer.delay_s = 2.0
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                await client.status(timeout=0.3)
            return status, results, err.value.code(), time.monotonic() - started

    status, results, code, elapsed = asyncio.run(scenario())
    assert status.workers[0].worker_id == "w0" and servicer.status_calls >= 3
    assert len(results) == 4 and len({(c.prompt_id, c.sample_index) for c in results}) == 4
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and elapsed < 1.5


def test_tls_with_a_private_ca(tmp_path):
    """The client verifies the server against --tls-ca (server name override for a test certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relayrl-controller")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("relayrl-controller")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / "ca.pem").write_bytes(cert_pem)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(ScriptedController(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key_pem, cert_pem)]))
    server.start()
    try:
        options = {"tls_ca": tmp_path / "ca.pem", "server_name": "relayrl-controller"}
        with RelayClient(f"127.0.0.1:{port}", **options) as client:
            assert client.status(timeout=10).run_name == "scripted"
        with RelayClient(f"127.0.0.1:{port}", attempts=1) as plaintext, pytest.raises(grpc.RpcError):
            plaintext.status(timeout=5)
    finally:
        server.stop(0)
