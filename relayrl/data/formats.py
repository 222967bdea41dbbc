"""The file types relayrl reads a dataset from: a file's suffix -> the ``datasets`` builder that loads it.
Light on purpose: the start-up checks (relayrl/ops/preflight.py) read it without importing ``datasets``."""

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
