"""gRPC plumbing shared by the SDK, the roles and their servers: channels, auth/TLS, retries, the generic server
scaffolding (health, reflection, error mapping) and request validation. The role servers live in ``services/``."""
