"""An environment server under mutual TLS and the bearer token, reached by ``EnvironmentClient``."""

from __future__ import annotations

import grpc
import pytest

from relayrl.config import SecurityConfig
from relayrl.env import EnvError, EnvironmentClient
from relayrl.env.examples.guess import GuessNumber
from relayrl.env.server import EnvironmentServer
from relayrl.rpc.auth import ClientSecurity

from .helpers import TOKEN_ENV


def test_environment_server_speaks_mtls_and_checks_the_token(pki, token, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, token)
    security = SecurityConfig(
        auth_token_env=TOKEN_ENV,
        tls_cert=str(pki.cert),
        tls_key=str(pki.key),
        tls_ca=str(pki.ca),
        require_client_cert=True,
    )
    server = EnvironmentServer(GuessNumber, security=security).start()
    try:
        env = EnvironmentClient(server.address, timeout_s=10, security=security)
        env.reset("s", {"secret": 3}, 0)
        assert env.step("s", {"role": "assistant", "content": "3"}).reward == 1.0
        rogue = SecurityConfig(
            auth_token_env=TOKEN_ENV, tls_cert=str(pki.rogue_cert), tls_key=str(pki.rogue_key), tls_ca=str(pki.ca)
        )
        for other in (ClientSecurity(token=token), rogue):  # plaintext; a certificate the CA never signed
            with pytest.raises(EnvError) as err:
                EnvironmentClient(server.address, timeout_s=5, security=other).info()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        monkeypatch.setenv(TOKEN_ENV, "a-different-token-of-enough-length")
        with pytest.raises(EnvError) as err:
            EnvironmentClient(server.address, timeout_s=5, security=security).info()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(grace_s=0)
