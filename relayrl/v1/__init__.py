"""Generated gRPC stubs for proto/relayrl/v1 (do not edit; `make proto` regenerates)."""
