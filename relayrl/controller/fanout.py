"""Call one RolloutService method on many workers at once (Pause, Resume, Stats)."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from relayrl.controller.workers import WorkerHandle


def fan_out(workers: Iterable[WorkerHandle], method: str, request, timeout_s: float) -> tuple[dict, dict[str, str]]:
    """``stub.<method>(request)`` on every worker concurrently.

    Returns ({worker id: response}, {worker id: "CODE: details"} for the calls that failed)."""
    futures = {w.worker_id: getattr(w.stub, method).future(request, timeout=timeout_s) for w in workers}
    responses, errors = {}, {}
    for worker_id, future in futures.items():
        try:
            responses[worker_id] = future.result()
        except grpc.RpcError as err:
            errors[worker_id] = f"{err.code().name}: {err.details()}"
    return responses, errors
