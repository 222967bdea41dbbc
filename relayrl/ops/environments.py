"""The environment servers of ``relayrl up`` (``environment.serve``): roles ``env-0`` .. ``env-<replicas-1>``.

Each replica is ``relayrl env serve <environment.serve> --port P`` on its own free port, started before the
controller and supervised like every role (a dead server is restarted on the same port, so its address stays
valid; the sessions it held are lost and their episodes fail). Their addresses are appended to
``environment.servers`` in the run's config.yaml before any role starts, so the controller reads them where it
reads servers started elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from relayrl.config import RelayConfig, load_config
from relayrl.env.client import EnvironmentClient
from relayrl.env.types import EnvError
from relayrl.runtime.ports import free_port


def environment_roles(cfg: RelayConfig) -> list[str]:
    env = cfg.environment
    return [f"env-{i}" for i in range(env.replicas)] if env is not None and env.serve else []


def add_environment_servers(config_path: Path, addresses: list[str]) -> RelayConfig:
    """Append ``addresses`` to ``environment.servers`` in the YAML at ``config_path`` (replaced atomically)."""
    raw = yaml.safe_load(config_path.read_text())
    raw["environment"]["servers"] = [*raw["environment"].get("servers", []), *addresses]
    tmp = config_path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
    tmp.replace(config_path)
    return load_config(config_path)


def start_environment_servers(job) -> list[str]:
    """Start the ``environment.serve`` replicas of ``job`` (the launcher's LocalJob); returns their roles. The run
    config gets their addresses first (``job.cfg`` is reloaded from it)."""
    roles = environment_roles(job.cfg)
    if not roles:
        return []
    ports = [free_port() for _ in roles]
    job.cfg = add_environment_servers(job.config_path, [f"127.0.0.1:{port}" for port in ports])
    env = job.cfg.environment
    for role, port in zip(roles, ports, strict=True):
        argv = ["env", "serve", env.serve, "--port", str(port), "--max-sessions", str(env.max_sessions)]
        job.spawn(role, job.relay(*argv, "--config", str(job.config_path)))
    return roles


def environments_serving(cfg: RelayConfig) -> bool:
    """Every address of ``environment.servers`` answers ``Info``: the readiness every EnvironmentService gives, written
    in any language from the .proto alone (which has no health service; relayrl's own servers serve one too)."""
    for address in cfg.environment.servers if cfg.environment is not None else []:
        client = EnvironmentClient(address, timeout_s=2)
        try:
            client.info()
        except EnvError:
            return False
        finally:
            client.disconnect()
    return True
