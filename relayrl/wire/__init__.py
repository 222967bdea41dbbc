"""Wire types: the plain values that cross the gRPC boundary (sampling parameters, a LoRA adapter's shape), as the
client, the controller, the engines and the trainer all use them. Below the config; nothing here does I/O."""
