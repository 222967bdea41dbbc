"""Each test's fork servers (``jobs.launch``) closed after it, and this process no longer a child subreaper."""

from __future__ import annotations

import pytest

from .jobs import release_forks


@pytest.fixture(autouse=True)
def _release_forks():
    yield
    release_forks()
