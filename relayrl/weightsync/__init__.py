"""Weight sync: one manifest per update, packed double-buffered buckets over a separate c10d group,
received in place into a ``WeightArena`` (or through staging buffers), a filesystem fallback driven
by the same manifest, and a checksum to compare the two ends."""

from relayrl.weightsync.arena import WeightArena, same_layout
from relayrl.weightsync.checksum import weights_checksum
from relayrl.weightsync.errors import WeightSyncError, WeightSyncTimeout
from relayrl.weightsync.filesystem import latest_version, read_weights, write_weights
from relayrl.weightsync.group import WeightBroadcastGroup, free_port
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
    "LayoutCache",
    "ManifestBuilder",
    "ReceiveStats",
    "SendStats",
    "TensorSpec",
    "TransferStats",
    "UnknownLayout",
    "WeightArena",
    "WeightBroadcastGroup",
    "WeightManifest",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncTimeout",
    "build_manifest",
    "free_port",
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
