"""Transfer statistics shared by the sender, the receiver and the filesystem fallback."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferStats:
    """``nbytes`` payload bytes moved in ``seconds``; ``peak_extra_bytes`` = staging memory held;
    ``checksum``: the fingerprint folded as the bytes went out / landed, verified in band ("" when the
    manifest asked for none)."""

    seconds: float
    nbytes: int
    buckets: int
    peak_extra_bytes: int
    checksum: str = ""

    @property
    def gbps(self) -> float:
        """Payload throughput in GB/s (1e9 bytes)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


SendStats = TransferStats
ReceiveStats = TransferStats
