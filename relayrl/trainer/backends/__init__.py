"""Training backends: how the policy is sharded, stepped, gathered and checkpointed."""

from relayrl.trainer.backends.fsdp import FSDPBackend

__all__ = ["FSDPBackend"]
