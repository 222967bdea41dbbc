"""Weight-sync failures. The first two are retryable at the RPC boundary: re-form the group and sync again."""

from __future__ import annotations

import grpc

from relayrl.errors import FailedPrecondition, RelayError


class WeightSyncError(RelayError):
    """A collective failed (a peer died, a receiver could not load) or the group is already broken."""

    code = grpc.StatusCode.UNAVAILABLE


class WeightSyncTimeout(WeightSyncError):
    """A collective did not complete within the group's timeout (a peer hangs or is gone)."""


class WeightMismatch(FailedPrecondition):
    """The bytes that landed are not the bytes that were sent (their fingerprints differ); the group is fine."""
