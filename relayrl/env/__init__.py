"""Environments for agentic multi-turn episodes: write one (``Environment``), serve it (``relayrl env serve``),
call one (``EnvironmentClient``, ``LocalEnvironmentClient``). The protocol: proto/relayrl/v1/environment.proto."""

from relayrl.env.base import Environment
from relayrl.env.client import (
    AsyncEnvironmentClient,
    AsyncLocalEnvironmentClient,
    EnvironmentClient,
    LocalEnvironmentClient,
)
from relayrl.env.types import EnvError, Reset, Step

__all__ = [
    "AsyncEnvironmentClient",
    "AsyncLocalEnvironmentClient",
    "EnvError",
    "Environment",
    "EnvironmentClient",
    "LocalEnvironmentClient",
    "Reset",
    "Step",
]
