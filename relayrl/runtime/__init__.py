"""Process plumbing shared by every role, below the config: the fork server, CPU lists and pinning, garbage-collector
and heap settings, process-tree helpers, addresses and ports. Nothing here knows about RL or the config."""
