"""Token authentication and (m)TLS on ControllerService and RolloutService (the token on ScorerService too):
refused without the token, with a wrong one, or (mTLS) without a client certificate signed by the CA; served with
the right ones; health checks need no token; reflection does."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from relayrl.config import ConfigError, SecurityConfig
from relayrl.rpc.auth import ClientSecurity, load_token
from relayrl.rpc.channels import open_channel
from relayrl.v1 import common_pb2, controller_pb2, controller_pb2_grpc, rollout_pb2, rollout_pb2_grpc

from .helpers import TOKEN_ENV, Pki, relay_config, running_servers

SERVICES = ["controller", "rollout"]


def unary_call(service: str) -> Callable[[grpc.Channel], object]:
    """A cheap read-only RPC of ``service``."""
    if service == "controller":
        return lambda ch: controller_pb2_grpc.ControllerServiceStub(ch).Status(
            controller_pb2.StatusRequest(), timeout=10
        )
    return lambda ch: rollout_pb2_grpc.RolloutServiceStub(ch).Stats(rollout_pb2.StatsRequest(), timeout=10)


def streaming_call(service: str) -> Callable[[grpc.Channel], list]:
    """The service's server-streaming RPC with a valid request, drained."""
    params = common_pb2.SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=2)
    if service == "controller":
        request = controller_pb2.SubmitPromptsRequest(
            prompts=[controller_pb2.SubmitPromptsRequest.Prompt(token_ids=[3, 4])], params=params
        )
        return lambda ch: list(controller_pb2_grpc.ControllerServiceStub(ch).SubmitPrompts(request, timeout=10))
    request = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.PromptInput(prompt_id="p", token_ids=[3, 4])], params=params
    )
    return lambda ch: list(rollout_pb2_grpc.RolloutServiceStub(ch).Generate(request, timeout=10))


def status_of(call: Callable[[grpc.Channel], object], channel: grpc.Channel) -> grpc.StatusCode:
    try:
        call(channel)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def health(channel: grpc.Channel, service: str = "") -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


@pytest.mark.parametrize("value", ["short-token", "has spaces in the middle of it", "ünïcödé-token-of-length"])
def test_weak_or_malformed_tokens_are_refused_without_being_echoed(monkeypatch, value) -> None:
    monkeypatch.setenv(TOKEN_ENV, value)
    with pytest.raises(ConfigError) as err:
        load_token(SecurityConfig(auth_token_env=TOKEN_ENV))
    assert str(err.value).startswith(f"{TOKEN_ENV}: ") and value not in str(err.value)


def test_unset_or_empty_token_turns_authentication_off(monkeypatch, token) -> None:
    cfg = SecurityConfig(auth_token_env=TOKEN_ENV)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_token(cfg) is None
    monkeypatch.setenv(TOKEN_ENV, "  ")
    assert load_token(cfg) is None
    monkeypatch.setenv(TOKEN_ENV, f" {token}\n")
    assert load_token(cfg) == token


# -- bearer token over plaintext -------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(tiny_model_dir, digits_path, tmp_path_factory, token):
    tmp = tmp_path_factory.mktemp("plain")
    cfg = relay_config(tiny_model_dir, digits_path, tmp / "runs", security={"auth_token_env": TOKEN_ENV})
    with running_servers(cfg, token, tmp / "controller") as addresses:
        yield dict(zip(SERVICES, addresses, strict=True))


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize("sent", [None, "wrong-token-of-plenty-length", "Bearer"])
def test_missing_or_wrong_token_is_unauthenticated(plain, service, sent) -> None:
    channel = open_channel(plain[service], security=ClientSecurity(token=sent))
    assert status_of(unary_call(service), channel) == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(streaming_call(service), channel) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("service", SERVICES)
def test_right_token_is_served(plain, service, token) -> None:
    """Controller streaming: SubmitPrompts goes on to the worker with the token of the controller's config."""
    channel = open_channel(plain[service], security=ClientSecurity(token=token))
    assert status_of(unary_call(service), channel) == grpc.StatusCode.OK
    assert status_of(streaming_call(service), channel) == grpc.StatusCode.OK


def test_the_channel_token_replaces_one_set_by_the_caller(plain, token) -> None:
    stub = controller_pb2_grpc.ControllerServiceStub(open_channel(plain["controller"], security=ClientSecurity(token)))
    stub.Status(controller_pb2.StatusRequest(), timeout=10, metadata=(("authorization", "Bearer forged"),))


@pytest.mark.parametrize("service", SERVICES)
def test_health_needs_no_token(plain, service) -> None:
    channel = open_channel(plain[service], security=ClientSecurity())
    name = {"controller": "relayrl.v1.ControllerService", "rollout": "relayrl.v1.RolloutService"}[service]
    assert health(channel) == health_pb2.HealthCheckResponse.SERVING
    assert health(channel, name) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("service", SERVICES)
def test_reflection_and_unknown_methods_need_the_token(plain, service, token) -> None:
    def list_services(channel: grpc.Channel) -> list:
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        return list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]), timeout=10))

    def unknown(channel: grpc.Channel) -> bytes:
        return channel.unary_unary("/relayrl.v1.Nope/Probe")(b"", timeout=10)

    anonymous = open_channel(plain[service], security=ClientSecurity())
    assert status_of(list_services, anonymous) == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(unknown, anonymous) == grpc.StatusCode.UNAUTHENTICATED
    authorized = open_channel(plain[service], security=ClientSecurity(token=token))
    assert status_of(list_services, authorized) == grpc.StatusCode.OK
    assert status_of(unknown, authorized) == grpc.StatusCode.UNIMPLEMENTED


# -- mTLS + token ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mtls(tiny_model_dir, digits_path, tmp_path_factory, token, pki: Pki):
    tmp = tmp_path_factory.mktemp("mtls")
    security = {
        "auth_token_env": TOKEN_ENV,
        "tls_cert": str(pki.cert),
        "tls_key": str(pki.key),
        "tls_ca": str(pki.ca),
        "require_client_cert": True,
    }
    cfg = relay_config(tiny_model_dir, digits_path, tmp / "runs", security=security)
    with running_servers(cfg, token, tmp / "controller") as addresses:
        yield dict(zip(SERVICES, addresses, strict=True))


def tls_client(pki: Pki, *, token: str | None, ca=None, cert=None, key=None) -> ClientSecurity:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(ca or pki.ca).read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )
    return ClientSecurity(token=token, credentials=credentials)


@pytest.mark.parametrize("service", SERVICES)
def test_mtls_with_certificate_and_token_is_served(mtls, service, token, pki) -> None:
    channel = open_channel(mtls[service], security=tls_client(pki, token=token, cert=pki.cert, key=pki.key))
    assert status_of(unary_call(service), channel) == grpc.StatusCode.OK
    assert status_of(streaming_call(service), channel) == grpc.StatusCode.OK


@pytest.mark.parametrize("service", SERVICES)
def test_mtls_without_client_certificate_fails_the_handshake(mtls, service, token, pki) -> None:
    channel = open_channel(mtls[service], security=tls_client(pki, token=token))
    assert status_of(unary_call(service), channel) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", SERVICES)
def test_mtls_with_a_certificate_of_another_ca_fails_the_handshake(mtls, service, token, pki) -> None:
    channel = open_channel(mtls[service], security=tls_client(pki, token=token, cert=pki.rogue_cert, key=pki.rogue_key))
    assert status_of(unary_call(service), channel) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", SERVICES)
def test_mtls_client_that_does_not_trust_the_server_fails(mtls, service, token, pki) -> None:
    security = tls_client(pki, token=token, ca=pki.rogue_ca, cert=pki.cert, key=pki.key)
    assert status_of(unary_call(service), open_channel(mtls[service], security=security)) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", SERVICES)
def test_mtls_plaintext_client_fails(mtls, service, token) -> None:
    channel = open_channel(mtls[service], security=ClientSecurity(token=token))
    assert status_of(unary_call(service), channel) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", SERVICES)
def test_mtls_certificate_without_token_is_unauthenticated(mtls, service, pki) -> None:
    channel = open_channel(mtls[service], security=tls_client(pki, token=None, cert=pki.cert, key=pki.key))
    assert status_of(unary_call(service), channel) == grpc.StatusCode.UNAUTHENTICATED
    assert health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_a_scorer_needs_the_token_and_its_health_does_not(token, tmp_path, monkeypatch) -> None:
    """ScorerService (relayrl reward serve) under the run's security section, as every relayrl server."""
    from relayrl.config import parse_config
    from relayrl.services.scorer_server import serve_scorer
    from relayrl.v1 import scorer_pb2, scorer_pb2_grpc
    from tests.unit.scorer_testing import write_tiny_reward_model

    monkeypatch.setenv(TOKEN_ENV, token)
    scorer = {"model": str(write_tiny_reward_model(tmp_path / "rm")), "precision": "float32"}
    raw = {"model": {"path": "m"}, "data": {"path": "d"}, "security": {"auth_token_env": TOKEN_ENV}}
    server, worker = serve_scorer(parse_config({**raw, "scorers": {"rm": scorer}}), "rm", host="127.0.0.1", port=0)
    address = f"127.0.0.1:{server.port}"

    def describe(channel: grpc.Channel) -> object:
        return scorer_pb2_grpc.ScorerServiceStub(channel).Describe(scorer_pb2.DescribeRequest(), timeout=10)

    try:
        refused = grpc.StatusCode.UNAUTHENTICATED
        for sent, code in ((None, refused), ("wrong-token-of-plenty-length", refused), (token, grpc.StatusCode.OK)):
            assert status_of(describe, open_channel(address, security=ClientSecurity(token=sent))) == code
        anonymous = open_channel(address, security=ClientSecurity())
        assert health(anonymous, "relayrl.v1.ScorerService") == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(grace_s=0)
        worker.stop()
