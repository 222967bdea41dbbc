"""Controller logic: ledger, worker registry, dispatch, rewards, batch production (no gRPC here)."""
