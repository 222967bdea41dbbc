"""The scorers of ``relayrl up`` (``scorers.<name>.replicas``): roles ``reward-<name>-0`` .. ``reward-<name>-<r-1>``.

Each replica is ``relayrl reward serve --name <name> --port P`` on its own free port, started before the
controller and supervised like every role (a dead scorer is restarted on the same port, so its address stays
valid; the controller's calls retry meanwhile, relayrl/rewards/served.py). Their addresses are appended to
``scorers.<name>.servers`` in the run's config.yaml before any role starts, so the controller reads them where it
reads scorers started elsewhere (as ``relayrl.ops.environments`` does for environment servers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relayrl.config import ConfigError, RelayConfig, load_config
from relayrl.ops.placement import SCORER_ROLE_PREFIX, claim, scorer_gpus, scorer_role, scorer_roles
from relayrl.rpc.channels import open_channel
from relayrl.runtime.files import atomic_write
from relayrl.runtime.ports import free_port
from relayrl.v1 import controller_pb2

log = logging.getLogger(__name__)


def add_scorer_servers(config_path: Path, addresses: dict[str, list[str]]) -> RelayConfig:
    """Append each scorer's ``addresses`` to ``scorers.<name>.servers`` in the YAML at ``config_path``."""
    raw = yaml.safe_load(config_path.read_text())
    for name, added in addresses.items():
        raw["scorers"][name]["servers"] = [*raw["scorers"][name].get("servers", []), *added]
    atomic_write(config_path, yaml.safe_dump(raw, sort_keys=False))
    return load_config(config_path)


def start_scorers(job) -> list[str]:
    """Start the scorer replicas of ``job`` (the launcher's LocalJob); returns their roles. The run config gets their
    addresses first (``job.cfg`` is reloaded from it)."""
    roles = scorer_roles(job.cfg)
    if not roles:
        return []
    ports = {role: free_port() for role in roles}
    addresses: dict[str, list[str]] = {}
    for role, (name, _) in roles.items():
        addresses.setdefault(name, []).append(f"127.0.0.1:{ports[role]}")
    job.cfg = add_scorer_servers(job.config_path, addresses)
    for role, (name, _) in roles.items():
        argv = ["reward", "serve", "--config", str(job.config_path), "--name", name, "--port", str(ports[role])]
        job.spawn(role, job.relay(*argv))
    return list(roles)


def scorers_serving(cfg: RelayConfig) -> bool:
    """Every address of every ``scorers.<name>.servers`` answers SERVING to the standard health check."""
    for scorer in cfg.scorers.values():
        for address in scorer.servers:
            channel = open_channel(address)
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
            finally:
                channel.close()
            if answer.status != health_pb2.HealthCheckResponse.SERVING:
                return False
    return True


class ScorerScaler:
    """Scaling ``relayrl up``'s scorer replicas to ``Status.desired_scorer_replicas`` (``relayrl scale reward N
    --name NAME``), from the launcher's watch loop. Scale-up starts ``reward-<name>-<k>`` (lowest free k) on a free
    port with ``--controller``: once serving it joins the servers the controller calls (RegisterScorer). On a GPU
    node it gets devices no role holds (``placement.claim``); where too few are free it is not started, and
    ``on_change`` says so once (it is tried again each tick: a scale-down frees devices). Scale-down stops the
    highest-numbered replicas with SIGTERM, freeing their devices: each leaves the controller's servers first, and
    its calls in flight finish within its grace (a call cut short is retried on another server)."""

    def __init__(self, job, stub, *, interval_s: float = 1.0, on_change: Callable[[str], None] = log.info) -> None:
        self.job, self.stub, self.interval_s, self.on_change = job, stub, interval_s, on_change
        self._next_tick = 0.0
        self._refused: dict[str, str] = {}  # scorer name -> the refusal last said

    def replicas(self, name: str) -> list[int]:
        """Indices of scorer ``name``'s running replicas."""
        prefix = f"{SCORER_ROLE_PREFIX}{name}-"
        return sorted(int(r.removeprefix(prefix)) for r in self.job.children if r.startswith(prefix))

    def tick(self) -> None:
        if time.monotonic() < self._next_tick or not self.job.cfg.scorers:
            return
        self._next_tick = time.monotonic() + self.interval_s
        try:
            desired = dict(self.stub.Status(controller_pb2.StatusRequest(), timeout=5).desired_scorer_replicas)
        except grpc.RpcError:
            return  # the controller is checked for liveness elsewhere
        for name, count in desired.items():
            running = self.replicas(name)
            for k in [k for k in range(len(running) + count) if k not in running][: max(0, count - len(running))]:
                if not self.start(name, scorer_role(name, k)):
                    break
            else:
                self._refused.pop(name, None)
            for k in running[count:] if count < len(running) else []:
                role = scorer_role(name, k)
                self.on_change(f"scale down: stopping {role}")
                self.job.stop([role])
                del self.job.children[role]
                self.job.devices.pop(role, None)  # its GPUs are free again

    def start(self, name: str, role: str) -> bool:
        """Start ``role``, a replica of scorer ``name``, on free GPUs when the node has any; False where too few are
        free (said once)."""
        if self.job.gpus:
            try:
                self.job.devices[role] = claim(
                    self.job.devices, self.job.gpus, role, scorer_gpus(self.job.cfg.scorers[name])
                )
            except ConfigError as err:
                if self._refused.get(name) != str(err):
                    self.on_change(f"scale up: {role} not started: {err}")
                    self._refused[name] = str(err)
                return False
        port = free_port()
        placed = f" (CUDA_VISIBLE_DEVICES={self.job.devices[role]})" if role in self.job.devices else ""
        self.on_change(f"scale up: starting {role} on port {port}{placed}")
        argv = ["reward", "serve", "--config", str(self.job.config_path), "--name", name, "--port", str(port)]
        self.job.spawn(role, self.job.relay(*argv, "--controller", self.job.controller_address))
        return True
