"""Call one RolloutService method on many workers at once (Pause, Resume, Stats)."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from relayrl.client.workers import WorkerHandle
from relayrl.errors import rpc_error_text


def fan_out(workers: Iterable[WorkerHandle], method: str, request, timeout_s: float) -> tuple[dict, dict[str, str]]:
    """``stub.<method>(request)`` on every worker concurrently.

    Returns ({worker id: response}, {worker id: "CODE: details"} for the calls that failed)."""
    futures, responses, errors = {}, {}, {}
    for worker in workers:
        try:
            futures[worker.worker_id] = getattr(worker.stub, method).future(request, timeout=timeout_s)
        except ValueError as err:  # its channel was closed: the worker was removed since the caller listed it
            errors[worker.worker_id] = f"UNAVAILABLE: worker removed ({err})"
    for worker_id, future in futures.items():
        try:
            responses[worker_id] = future.result()
        except grpc.RpcError as err:
            errors[worker_id] = rpc_error_text(err)
    return responses, errors
