"""Weight sync: one manifest per update, packed double-buffered buckets over a separate c10d group,
a filesystem fallback driven by the same manifest, and a checksum to compare the two ends."""

from relayrl.weightsync.checksum import weights_checksum
from relayrl.weightsync.errors import WeightSyncError, WeightSyncTimeout
from relayrl.weightsync.filesystem import latest_version, read_weights, write_weights
from relayrl.weightsync.group import WeightBroadcastGroup, free_port
from relayrl.weightsync.manifest import BucketSpec, TensorSpec, WeightManifest, build_manifest
from relayrl.weightsync.packing import BufferPair, pack_bucket, unpack_bucket
from relayrl.weightsync.receiver import receive_weights
from relayrl.weightsync.sender import WeightSender
from relayrl.weightsync.stats import ReceiveStats, SendStats, TransferStats

__all__ = [
    "BucketSpec",
    "BufferPair",
    "ReceiveStats",
    "SendStats",
    "TensorSpec",
    "TransferStats",
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
    "receive_weights",
    "unpack_bucket",
    "weights_checksum",
    "write_weights",
]
