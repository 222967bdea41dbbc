"""Fixtures of the security tests: one PKI and one token per session."""

from __future__ import annotations

import secrets

import pytest

from .helpers import Pki, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def token() -> str:
    return secrets.token_urlsafe(32)
