"""Process plumbing shared by every role: the local launcher and its fork server, thread and CPU placement,
garbage-collector and heap settings, process-tree helpers and ports. Nothing here knows about RL."""
