"""Weight sync: one manifest per update, packed double-buffered buckets over a separate c10d group,
received in place into a ``WeightArena`` (or through staging buffers), a filesystem fallback driven
by the same manifest, and checksums to compare the two ends: a fingerprint folded as the chunks pass
and compared in band (over a sample of the blocks by default, or all of them), or sha256."""

from relayrl.weightsync.arena import Placement, WeightArena, arena_placement, same_layout
from relayrl.weightsync.checksum import checksum_method, weights_checksum
from relayrl.weightsync.errors import WeightMismatch, WeightSyncError, WeightSyncTimeout
from relayrl.weightsync.filesystem import latest_version, read_weights, write_weights
from relayrl.weightsync.fingerprint import Fingerprinter
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.weightsync.manifest import (
    BucketSpec,
    LayoutCache,
    ManifestBuilder,
    TensorSpec,
    UnknownLayout,
    WeightManifest,
    build_manifest,
)
from relayrl.weightsync.packing import BufferPair, pack_bucket, unpack_bucket
from relayrl.weightsync.receiver import receive_into, receive_weights
from relayrl.weightsync.sender import WeightSender
from relayrl.weightsync.stats import ReceiveStats, SendStats, TransferStats

__all__ = [
    "BucketSpec",
    "BufferPair",
    "Fingerprinter",
    "LayoutCache",
    "ManifestBuilder",
    "Placement",
    "ReceiveStats",
    "SendStats",
    "TensorSpec",
    "TransferStats",
    "UnknownLayout",
    "WeightArena",
    "WeightBroadcastGroup",
    "WeightManifest",
    "WeightMismatch",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncTimeout",
    "arena_placement",
    "build_manifest",
    "checksum_method",
    "latest_version",
    "pack_bucket",
    "read_weights",
    "receive_into",
    "receive_weights",
    "same_layout",
    "unpack_bucket",
    "weights_checksum",
    "write_weights",
]
