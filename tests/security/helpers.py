"""Helpers of the security tests: a throw-away PKI (made with ``cryptography``) and relayrl servers
(controller + rollout worker) running in this process under a given ``security`` section."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from relayrl.config import RelayConfig, parse_config
from relayrl.rpc.channels import configure_client
from relayrl.services.controller_server import serve_controller
from relayrl.services.rollout_server import serve_rollout

TOKEN_ENV = "RELAYRL_TEST_AUTH_TOKEN"


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA and a peer certificate it signed (localhost / 127.0.0.1, server and client use), and a
    rogue CA with a peer certificate of its own."""

    ca: Path
    cert: Path
    key: Path
    rogue_ca: Path
    rogue_cert: Path
    rogue_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    )
    if ca:
        usage = x509.KeyUsage(
            digital_signature=False,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=True,
            crl_sign=True,
            encipher_only=False,
            decipher_only=False,
        )
        builder = builder.add_extension(usage, critical=True)
    else:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write_pair(directory: Path, stem: str, cert: x509.Certificate, key) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def make_pki(directory: Path) -> Pki:
    paths = {}
    for prefix in ("", "rogue_"):
        ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca_name = f"relayrl test {prefix}ca"
        ca = _certificate(ca_name, ca_key, ca_name, ca_key, ca=True)
        leaf = _certificate(f"relayrl {prefix}peer", key, ca_name, ca_key, ca=False)
        paths[f"{prefix}ca"], _ = _write_pair(directory, f"{prefix}ca", ca, ca_key)
        paths[f"{prefix}cert"], paths[f"{prefix}key"] = _write_pair(directory, f"{prefix}peer", leaf, key)
    return Pki(**paths)


def relay_config(model_dir: Path, data_path: Path, run_dir: Path, **sections) -> RelayConfig:
    """A small valid config (tiny model, digits data) with whole sections replaced by ``sections``."""
    raw = {
        "run": {"name": "security", "dir": str(run_dir)},
        "model": {"path": str(model_dir)},
        "data": {"path": str(data_path)},
        "rollout": {"n": 2, "max_tokens": 4},
        "controller": {"prompts_per_gen_batch": 2, "train_batch_groups": 2},
        "trainer": {"mini_batches": 1},
        **sections,
    }
    return parse_config(raw)


@contextlib.contextmanager
def running_servers(cfg: RelayConfig, token: str | None, state_dir: Path) -> Iterator[tuple[str, str]]:
    """A controller and a rollout worker in this process, the worker registered as "w0" (the controller
    reaches it with the config's security); yields their addresses."""
    with pytest.MonkeyPatch.context() as env:
        if token is None:
            env.delenv(cfg.security.auth_token_env, raising=False)
        else:
            env.setenv(cfg.security.auth_token_env, token)
        controller_server, controller = serve_controller(cfg, port=0, state_dir=str(state_dir))
        rollout_server, _, _ = serve_rollout(
            cfg, controller=None, host="127.0.0.1", port=0, advertise=None, worker_id="w0"
        )
        rollout_address = f"127.0.0.1:{rollout_server.port}"
        controller.registry.register("w0", rollout_address, "hf", 0)
        try:
            yield f"127.0.0.1:{controller_server.port}", rollout_address
        finally:
            rollout_server.stop(0)
            controller_server.stop(0)
            controller.stop()
            configure_client(None)
