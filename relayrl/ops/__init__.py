"""Operating a job: the operator commands and their output, supervision, placement, scaling (local, Kubernetes,
Slurm) and the environment servers of ``relayrl up``."""
