"""A rollout worker's registration renewed by the controller's own calls (no torch: the bench's simulated
workers use it too)."""

from __future__ import annotations

import math
import time


class Registration:
    """When this worker last answered a controller dispatch in full (``renews_registration``), which the
    controller counts as a heartbeat (``relayrl/controller/dispatch.py``): a busy worker need not also beat."""

    def __init__(self) -> None:
        self.renewed_at = -math.inf  # time.monotonic(), the clock of asyncio's default loop too

    def renew(self) -> None:
        self.renewed_at = time.monotonic()

    def renewed_for(self, interval_s: float) -> float:
        """Seconds until a beat is due: ``renewed_at + interval_s - now`` (<= 0: due now)."""
        return self.renewed_at + interval_s - time.monotonic()
