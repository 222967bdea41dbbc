"""How a role uses the machine's cores: torch threads per role, CPU pinning and the trainer's priority, from the
config (the config-free CPU helpers are ``runtime/cpus.py``)."""
