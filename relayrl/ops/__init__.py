"""Operating a running job: the operator commands, their output, and scaling (local and Kubernetes)."""
