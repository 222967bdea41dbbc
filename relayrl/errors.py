"""Errors that carry a gRPC status: raised anywhere, mapped to a precise status at the RPC boundary."""

from __future__ import annotations

import grpc


class RelayError(Exception):
    """Base error; ``code`` is the gRPC status the RPC boundary answers with."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(RelayError):
    """A request field is wrong. The message always starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class ResourceExhausted(RelayError):
    """A configured limit (queue, batch size, message size) would be exceeded."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, field: str, limit: int | float, got: int | float) -> None:
        self.field = field
        super().__init__(f"{field}: {got} exceeds the limit {limit}")


# While an operator has paused the run, UNAVAILABLE details start with this (the trainer keeps waiting).
PAUSED_DETAIL = "run paused by an operator"
# While the batch a trainer pulls is still being generated, UNAVAILABLE details start with this (a normal wait).
NOT_READY_DETAIL = "no batch for step"
# A run that failed for good (a deterministic error: a restart would fail alike) has an error starting with this;
# `relayrl up` stops on it instead of restarting the trainer.
RUN_STOPPED_DETAIL = "run stopped"


class Unavailable(RelayError):
    """Retryable: the server is paused, draining or not ready yet."""

    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(RelayError):
    """The request does not fit the server's state (e.g. a policy-version mismatch)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(RelayError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(RelayError):
    """The request would create something that exists already (e.g. an environment session id in use)."""

    code = grpc.StatusCode.ALREADY_EXISTS


def rpc_error_text(err: grpc.RpcError) -> str:
    """How a failed call is reported everywhere (logs, ledger reasons, CLI): ``"<STATUS>: <details>"``."""
    return f"{err.code().name}: {err.details()}"
