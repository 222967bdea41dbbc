"""Controller logic: ledger, dispatch, rewards, batch production (no gRPC here; the worker registry is
``client/workers.py``)."""
