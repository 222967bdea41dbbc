"""``relayrl up``'s environment servers (``environment.serve``): started as roles, their addresses in the run
config, supervised (kill -9 -> restarted on the same address within the budget, logged)."""

from __future__ import annotations

import os
import signal

from relayrl.config import load_config
from relayrl.env import EnvironmentClient
from relayrl.launcher import LocalJob
from relayrl.ops.environments import environments_serving, start_environment_servers
from relayrl.ops.supervise import Supervisor
from tests.integration.jobs import wait_until

GUESS = "relayrl.env.examples.guess:GuessNumber"


def test_environment_servers_start_publish_their_addresses_and_come_back(make_config) -> None:
    path = make_config(
        environment={"serve": GUESS, "replicas": 2, "max_sessions": 3, "servers": ["elsewhere:5000"]},
        supervisor={"backoff_s": 0, "fork_roles": False},
    )
    cfg = load_config(path)
    (cfg.run_dir / "logs").mkdir(parents=True)
    config_path = cfg.run_dir / "config.yaml"
    config_path.write_text(path.read_text())
    job = LocalJob(cfg, config_path, cfg.run_dir / "logs")
    events: list[str] = []
    try:
        assert start_environment_servers(job) == ["env-0", "env-1"]
        servers = load_config(config_path).environment.servers  # what the controller reads
        assert servers[0] == "elsewhere:5000" and len(servers) == 3
        ours = load_config(config_path)
        ours.environment.servers = servers[1:]
        wait_until(lambda: environments_serving(ours), 60, "environment servers")
        env = EnvironmentClient(servers[1], timeout_s=10)
        assert env.info() == {"name": "guess-number", "max_sessions": 3, "sessions": 0}
        env.reset("episode", {"secret": 2}, 0)
        EnvironmentClient(servers[2], timeout_s=10).reset("episode", {"secret": 2}, 0)

        supervisor = Supervisor(job, cfg.supervisor, cfg.run_dir, on_event=events.append)
        killed = job.children["env-0"].pid
        os.kill(killed, signal.SIGKILL)
        job.children["env-0"].wait()

        def restarted() -> bool:
            supervisor.tick()
            return job.children["env-0"].pid != killed and environments_serving(ours)

        wait_until(restarted, 60, "env-0 restarted")
        assert events[0].startswith("env-0 exited with code -9; restart 1/3")
        assert EnvironmentClient(servers[1], timeout_s=10).info()["sessions"] == 0  # same address, sessions gone
        assert EnvironmentClient(servers[2], timeout_s=10).info()["sessions"] == 1  # the other server kept its own
        assert EnvironmentClient(servers[2], timeout_s=10).step("episode", {"role": "assistant", "content": "2"}).done
    finally:
        job.stop(grace_s=10)
