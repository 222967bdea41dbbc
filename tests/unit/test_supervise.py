"""The supervisor's pieces without a run: restart budget and backoff, GPU placement and the env children get."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import yaml

from relayrl.config import ConfigError, SupervisorConfig, parse_config
from relayrl.launcher import LocalJob
from relayrl.ops.placement import claim, place
from relayrl.ops.scorers import ScorerScaler, start_scorers
from relayrl.ops.supervise import RestartBudget, RestartBudgetExhausted, RunStopped, Supervisor, read_restarts

GPU_RUN = {
    "model": {"path": "m"},
    "data": {"path": "d"},
    "rollout": {"engine": "vllm", "workers": 4, "n": 8, "engine_options": {"tensor_parallel_size": 1}},
    "controller": {"train_batch_groups": 8},
    "trainer": {"nproc": 4},
}


def gpu_config(**rollout_options):
    raw = yaml.safe_load(yaml.safe_dump(GPU_RUN))
    raw["rollout"]["engine_options"].update(rollout_options)
    return parse_config(raw)


def test_backoff_doubles_up_to_its_cap_and_the_budget_runs_out():
    budget = RestartBudget(SupervisorConfig(max_restarts=3, backoff_s=1.0, backoff_max_s=3.0))
    delays = []
    while not budget.exhausted("rollout-0"):
        delays.append(budget.delay_s("rollout-0"))
        budget.record("rollout-0")
    assert delays == [1.0, 2.0, 3.0]
    assert not budget.exhausted("rollout-1")


def test_eight_gpus_four_workers_and_a_four_rank_trainer_get_disjoint_devices(tmp_path):
    devices = place(gpu_config(), [str(i) for i in range(8)])
    assert devices == {
        "rollout-0": "0",
        "rollout-1": "1",
        "rollout-2": "2",
        "rollout-3": "3",
        "trainer": "4,5,6,7",
    }
    # ...and that is the environment each child is started with
    job = LocalJob(gpu_config(), tmp_path / "config.yaml", tmp_path, devices=devices)
    show = [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"]
    for role in devices:
        job.spawn(role, show).wait(timeout=60)
    seen = {role: (tmp_path / f"{role}.log").read_text().strip() for role in devices}
    assert seen == devices
    used = [d for ids in seen.values() for d in ids.split(",")]
    assert sorted(used) == sorted(set(used))


def test_tensor_parallel_workers_that_do_not_fit_are_refused_with_the_numbers():
    with pytest.raises(ConfigError, match=r"needs 12 GPUs \(4 rollout workers x 2 \+ 4 trainer ranks\).*has 8"):
        place(gpu_config(tensor_parallel_size=2), [str(i) for i in range(8)])
    assert place(gpu_config(), []) == {}  # a CPU node: nothing placed


SCORED_RUN = {
    **GPU_RUN,
    "rollout": {**GPU_RUN["rollout"], "workers": 2},
    "trainer": {"nproc": 2},
    "scorers": {
        "rm": {"model": "rm", "replicas": 2},
        "judge": {"kind": "judge", "model": "j", "engine": "vllm", "engine_options": {"tensor_parallel_size": 2}},
        "elsewhere": {"model": "rm", "replicas": 0, "servers": ["10.0.0.9:50053"]},
    },
}


def test_each_scorer_replica_gets_its_own_devices_after_the_trainer_a_judge_its_engines_parallel_size():
    devices = [str(i) for i in range(8)]
    assert place(parse_config(SCORED_RUN), devices) == {
        "rollout-0": "0",
        "rollout-1": "1",
        "trainer": "2,3",
        "reward-rm-0": "4",
        "reward-rm-1": "5",
        "reward-judge-0": "6,7",  # vLLM tensor_parallel_size 2; `elsewhere` (replicas 0) is started by no one here
    }
    assert place(parse_config({k: v for k, v in SCORED_RUN.items() if k != "scorers"}), devices) == {
        "rollout-0": "0",
        "rollout-1": "1",
        "trainer": "2,3",
    }  # without scorers: the plan of a run before scorers were placed


def test_a_scorer_that_does_not_fit_is_refused_with_the_numbers():
    sglang = {"kind": "judge", "model": "j", "engine": "sglang", "engine_options": {"tp_size": 2, "pp_size": 2}}
    cfg = parse_config({**SCORED_RUN, "scorers": {"teacher": {"kind": "teacher", "model": "t"}, "sj": sglang}})
    assert place(cfg, [str(i) for i in range(9)])["reward-sj-0"] == "5,6,7,8"  # tp_size x pp_size
    numbers = (
        r"needs 9 GPUs \(2 rollout workers x 1 \+ 2 trainer ranks \+ 1 scorers.teacher replicas x 1 "
        r"\+ 1 scorers.sj replicas x 4\) but the node has 8$"
    )
    with pytest.raises(ConfigError, match=r"^supervisor.gpus: the run " + numbers):
        place(cfg, [str(i) for i in range(8)])


def test_a_scaled_up_scorer_claims_free_devices_only():
    node = [str(i) for i in range(10)]
    plan = place(parse_config(SCORED_RUN), node)
    assert claim(plan, node, "reward-judge-1", 2) == "8,9"
    with pytest.raises(ConfigError, match=r"^supervisor.gpus: reward-judge-1 needs 2 GPUs but 0 of the node's 8 are"):
        claim(plan, node[:8], "reward-judge-1", 2)
    del plan["reward-rm-0"]  # stopped by a scale-down: its device is free again
    assert claim(plan, node[:8], "reward-rm-2", 1) == "4"


class ShownJob(LocalJob):
    """A LocalJob whose every role prints the CUDA_VISIBLE_DEVICES it was started with, then exits."""

    def relay(self, *args: str) -> list[str]:
        return [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"]


def test_scorers_start_and_scale_up_on_their_own_devices_and_a_scale_beyond_the_free_ones_is_refused(tmp_path):
    """start_scorers and ScorerScaler (relayrl up's and `relayrl scale reward N`'s) give each scorer child the
    devices its plan names; a replica no free device is left for is not started and said once; a scale-down frees."""
    config = tmp_path / "config.yaml"
    raw = {**GPU_RUN, "rollout": {**GPU_RUN["rollout"], "workers": 1}, "trainer": {"nproc": 1}}
    config.write_text(yaml.safe_dump({**raw, "scorers": {"rm": {"model": "rm"}}}))
    (tmp_path / "logs").mkdir()
    job = ShownJob(parse_config(yaml.safe_load(config.read_text())), config, tmp_path / "logs", gpus=list("0123"))
    job.devices = place(job.cfg, job.gpus)
    assert start_scorers(job) == ["reward-rm-0"]
    desired = {"rm": 3}
    stub = SimpleNamespace(Status=lambda request, timeout: SimpleNamespace(desired_scorer_replicas=desired))
    said: list[str] = []
    scaler = ScorerScaler(job, stub, interval_s=0.0, on_change=said.append)
    scaler.tick()
    scaler.tick()  # reward-rm-2 still finds no free device: not said again
    assert said[0].startswith("scale up: starting reward-rm-1 on port") and said[0].endswith("(CUDA_VISIBLE_DEVICES=3)")
    assert said[1:] == [
        "scale up: reward-rm-2 not started: supervisor.gpus: reward-rm-2 needs 1 GPU but 0 of the node's 4 are free"
    ]
    for proc in job.children.values():
        proc.wait(timeout=60)
    seen = {role: (tmp_path / "logs" / f"{role}.log").read_text().split() for role in job.children}
    assert seen == {"reward-rm-0": ["2"], "reward-rm-1": ["3"]}  # rollout-0 holds 0, the trainer 1
    desired["rm"] = 1
    scaler.tick()
    assert "reward-rm-1" not in job.children and "reward-rm-1" not in job.devices
    desired["rm"] = 2
    scaler.tick()
    job.children["reward-rm-1"].wait(timeout=60)
    assert (tmp_path / "logs" / "reward-rm-1.log").read_text().split() == ["3", "3"]  # the freed device, again


def test_relayrl_up_refuses_over_subscription_before_starting_anything(tmp_path):
    config = tmp_path / "gpu.yaml"
    config.write_text(yaml.safe_dump({**GPU_RUN, "run": {"dir": str(tmp_path / "runs")}}))
    sets = ["rollout.engine_options.tensor_parallel_size=2", "supervisor.gpus=8"]
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(config), *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "supervisor.gpus: the run needs 12 GPUs" in done.stderr and "node has 8" in done.stderr
    assert not (tmp_path / "runs").exists()


class Died:
    """A child that already exited with ``code``."""

    def __init__(self, code: int, pid: int = 1) -> None:
        self.returncode, self.pid = code, pid

    def poll(self) -> int:
        return self.returncode


def test_supervisor_restarts_with_backoff_then_names_the_role_that_exhausted_its_budget(tmp_path):
    respawned = []
    job = SimpleNamespace(children={"rollout-0": Died(-9), "trainer": Died(0)}, logs=tmp_path / "logs")

    def respawn(role):
        respawned.append(role)
        job.children[role] = Died(-9, pid=100 + len(respawned))

    job.respawn = respawn
    supervisor = Supervisor(job, SupervisorConfig(max_restarts=2, backoff_s=0.05), tmp_path)
    deadline = time.monotonic() + 10
    with pytest.raises(RestartBudgetExhausted, match=r"rollout-0 exited with code -9 after 2 restarts.*rollout-0\.log"):
        while time.monotonic() < deadline:
            supervisor.tick()
            time.sleep(0.01)
    assert respawned == ["rollout-0", "rollout-0"]  # a trainer that finished (code 0) is left alone
    assert read_restarts(tmp_path) == {"rollout-0": 2, "trainer": 0}


def test_a_start_up_refusal_or_a_run_the_controller_stopped_is_not_restarted(tmp_path):
    """Exit code 2 (a config error, a corrupt ledger) of any role, or a trainer whose run the controller stopped
    for good (``run_stopped`` says why): RunStopped at once, nothing respawned."""

    def respawn(role):
        raise AssertionError(f"{role} restarted")

    refused = SimpleNamespace(children={"controller": Died(2)}, logs=tmp_path / "logs", respawn=respawn)
    with pytest.raises(RunStopped, match=r"^controller refused to start \(exit code 2\)"):
        Supervisor(refused, SupervisorConfig(max_restarts=2, backoff_s=0.05), tmp_path).tick()
    stopped = SimpleNamespace(children={"trainer": Died(1)}, logs=tmp_path / "logs", respawn=respawn)
    supervisor = Supervisor(stopped, SupervisorConfig(), tmp_path, run_stopped=lambda: "run stopped: step 1: ...")
    with pytest.raises(RunStopped, match=r"^run stopped: step 1"):
        supervisor.tick()
    assert read_restarts(tmp_path) == {"trainer": 0}


def test_a_damaged_supervisor_state_is_a_warning_naming_it_not_zero_restarts_unseen(tmp_path, caplog):
    assert read_restarts(tmp_path) == {}  # no supervisor: nothing to say
    (tmp_path / "supervisor.json").write_text('{"roles": {"trainer": {"restar')
    with caplog.at_level("WARNING", logger="relayrl.ops.supervise"):
        assert read_restarts(tmp_path) == {}
    assert "supervisor.json is unreadable" in caplog.text, caplog.text


def test_a_receiver_that_refuses_the_connection_is_left_out_at_once_and_not_probed_again():
    from relayrl.config import WeightSyncConfig
    from relayrl.runtime.ports import free_port
    from relayrl.trainer.sync import WeightPublisher

    publisher = WeightPublisher(WeightSyncConfig(timeout_s=60), controller=None, weights_dir="unused")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    first = publisher._unreachable({"rollout-1": dead})
    assert first["rollout-1"].startswith("unreachable: UNAVAILABLE")  # refused at once, not DEADLINE_EXCEEDED
    again = publisher._unreachable({"rollout-1": dead})
    assert "not probed again" in again["rollout-1"]
    assert publisher._unreachable({"rollout-1": "127.0.0.1:1"}) != {}  # a new address (a restart) is probed


def test_relayrl_status_shows_the_restarts():
    from rich.console import Console

    from relayrl.ops.render import status_tables
    from relayrl.v1 import controller_pb2

    console = Console(width=200, record=True)
    for table in status_tables(controller_pb2.StatusResponse(restarts={"rollout-1": 2, "controller": 0})):
        console.print(table)
    assert "rollout-1 2" in console.export_text() and "controller 0" not in console.export_text()


@pytest.mark.parametrize("driver", [False, True], ids=["no-driver", "driver-node"])
def test_gpus_are_counted_through_torch_only_where_a_gpu_driver_is(tmp_path, driver):
    node = tmp_path / "nvidiactl"
    if driver:
        node.touch()
    probe = (
        "import sys; import relayrl.ops.placement as p; "
        f"p.GPU_DRIVER_NODES = ({str(node)!r},); "
        "print(p.node_devices(None), 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    devices, imported = done.stdout.split()[0], done.stdout.split()[-1]
    assert imported == str(driver)  # torch (seconds to import) only where it could find a device
    if not driver:
        assert devices == "[]"
