"""A served reward model through ``relayrl up`` (issue 46, items 3-4): the run's only reward is a tiny reward model
served by a supervised scorer role (``scorers.rm``, ``controller.reward.fns: {scorer:rm: 1}``). ``relayrl status``
lists the scorer; killed with SIGKILL after the first step, it is restarted on its port while the controller's Score
calls retry: the run completes, every prompt drawn is trained once (none failed), and each step's metrics carry the
scorer's latency, calls and batch size. A scorer that refuses every request (its token limit below any
conversation) stops the run within its first step with the scorer's error on the console. ``relayrl scale reward``
adds a scorer mid-run that serves beside the first, and removes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from relayrl.algorithms.advantages import grpo_advantage
from relayrl.config import load_config
from relayrl.launcher import controller_status
from relayrl.ops.render import status_tables
from relayrl.trainer.metrics import read_metrics
from tests.unit.scorer_testing import write_tiny_reward_model

from .jobs import finish, ledger_fates, running_up, start_up, supervised_roles, wait_until

pytestmark = pytest.mark.slow

RESTARTED = "controller restarted before the prompt was trained"  # the ledger's reason (controller/core.py)
SHAPE = {"prompts_per_gen_batch": 4, "train_batch_groups": 4, "dynamic_sampling": False}


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return write_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", seed=3)


def served_config(make_config, name: str, reward_model, steps: int, supervisor: dict | None = None, **scorer):
    return make_config(
        name,
        scorers={"rm": {"model": str(reward_model), "precision": "float32", **scorer}},
        controller={**SHAPE, "reward": {"fns": {"scorer:rm": 1.0}}},
        trainer={"steps": steps},
        rollout={"workers": 1},
        supervisor=supervisor or {},
    )


@pytest.mark.timeout(900)
def test_a_served_reward_model_trains_through_a_scorer_killed_mid_run(tmp_path, make_config, reward_model):
    steps = 4
    config = served_config(make_config, "served", reward_model, steps)
    cfg = load_config(config)
    up = start_up(config)
    deadline = time.monotonic() + 600
    while len(read_metrics(cfg.run_dir / "metrics.jsonl")) < 1:
        assert up.poll() is None and time.monotonic() < deadline, finish(up)[1]
        time.sleep(0.2)
    status = controller_status((cfg.run_dir / "controller.address").read_text())  # what `relayrl status` shows
    (scorer,) = status.scorers
    assert (scorer.name, scorer.kind, scorer.error) == ("rm", "classifier", "") and scorer.items_scored > 0
    assert "scorers" in [table.title for table in status_tables(status)]
    os.kill(supervised_roles(cfg)["reward-rm-0"]["pid"], signal.SIGKILL)
    code, err = finish(up)
    assert code == 0, err
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all("rewards/rm" in r for r in records)  # the served score is the reward, logged under the scorer's name
    assert all(r["scorer/rm/calls"] >= SHAPE["prompts_per_gen_batch"] and r["scorer/rm/latency_s"] > 0 for r in records)
    assert records[0]["scorer/rm/batch_size"] >= 1 and "scorer/rm/queued" in records[0]
    assert supervised_roles(cfg)["reward-rm-0"]["restarts"] == 1
    fates = ledger_fates(cfg)
    assert all(f[-1] in ("trained", "filtered") and f.count("trained") <= 1 for f in fates.values()), fates
    assert not [pid for pid, f in fates.items() if "failed" in f]  # the kill lost no prompt
    assert sum(f.count("trained") for f in fates.values()) == steps * SHAPE["train_batch_groups"]


@pytest.mark.timeout(900)
def test_a_scorer_that_refuses_every_request_stops_the_run_with_its_error(tmp_path, make_config, reward_model):
    config = served_config(make_config, "refused", reward_model, 3, max_tokens=4)
    code, err = finish(start_up(config))
    cfg = load_config(config)
    assert code == 1, err
    assert "run stopped: step 1: 4 of the 4 prompts scored failed their reward function" in err, err
    assert "scorer rm: RESOURCE_EXHAUSTED: items[0] tokens:" in err and "exceeds the limit 4" in err, err
    assert read_metrics(cfg.run_dir / "metrics.jsonl") == []
    assert supervised_roles(cfg)["reward-rm-0"]["restarts"] == 0  # the scorer itself never died


def scorer_servers(cfg) -> list:
    """The scorer servers the run's controller calls, as ``relayrl status`` lists them."""
    return list(controller_status((cfg.run_dir / "controller.address").read_text()).scorers)


def serving_count(cfg) -> int:
    """How many scorer servers the run's controller calls; 0 while it does not answer (restarting)."""
    try:
        return len(scorer_servers(cfg))
    except grpc.RpcError:
        return 0


def supervisor_log(cfg) -> str:
    """The run's ``logs/supervisor.log``: its restart and scale events; empty before the first."""
    path = cfg.run_dir / "logs" / "supervisor.log"
    return path.read_text() if path.exists() else ""


def scale_reward(cfg, replicas: int) -> str:
    argv = [sys.executable, "-m", "relayrl.cli", "scale", "reward", str(replicas), "--name", "rm"]
    done = subprocess.run([*argv, "--run", str(cfg.run_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


# 4 GPUs: rollout-0, the trainer, reward-rm-0 and reward-rm-1 hold one each
REFUSED = "scale up: reward-rm-2 not started: supervisor.gpus: reward-rm-2 needs 1 GPU but 0 of the node's 4 are free"


@pytest.mark.timeout(900)
def test_relayrl_scale_reward_adds_a_scorer_that_serves_and_removes_it(tmp_path, make_config, reward_model):
    """`relayrl scale reward 2 --name rm` mid-run: relayrl up starts reward-rm-1, which joins the servers the
    controller calls and scores groups beside reward-rm-0. On a node of 4 GPUs (``supervisor.gpus``, on this CPU
    machine: the ids placed, not used) each scorer gets its own: rollout-0 holds 0, the trainer 1, reward-rm-0 2 and
    reward-rm-1 3, so `scale reward 3` finds none for reward-rm-2, which is not started (said once). The controller,
    killed with SIGKILL, is restarted with the desired count it persisted (3, as `scale rollout`'s): relayrl up keeps
    the two replicas (none started or stopped) and reward-rm-1 joins the restarted controller's servers again.
    `scale reward 1` stops it and it leaves them; the run completes with every prompt trained at most once, the only
    failed ones those the restart failed."""
    steps = 120  # a tiny model's step takes ~0.2 s on a quiet machine: the run outlasts two scale calls and a restart
    supervisor = {"backoff_s": 0.5, "gpus": 4}
    config = served_config(make_config, "scaled", reward_model, steps, supervisor=supervisor)
    cfg = load_config(config)
    with running_up(config) as up:
        wait_until(lambda: len(read_metrics(cfg.run_dir / "metrics.jsonl")) >= 1, 600, "step 1")
        assert "desired servers of scorer rm unset -> 2" in scale_reward(cfg, 2)
        wait_until(
            lambda: len(servers := scorer_servers(cfg)) == 2 and all(s.items_scored > 0 for s in servers),
            300,
            "two scorer servers, each scoring",
        )
        for replica, device in (("reward-rm-0", "2"), ("reward-rm-1", "3")):  # as each scorer logs where it serves
            assert (
                f"on cpu, CUDA_VISIBLE_DEVICES={device}) serving"
                in (cfg.run_dir / "logs" / f"{replica}.log").read_text()
            )
        assert "desired servers of scorer rm 2 -> 3" in scale_reward(cfg, 3)
        wait_until(lambda: REFUSED in supervisor_log(cfg), 120, "reward-rm-2 refused")  # before the controller dies
        killed = supervised_roles(cfg)["controller"]["pid"]
        os.kill(killed, signal.SIGKILL)
        wait_until(lambda: supervised_roles(cfg)["controller"]["pid"] != killed, 120, "the controller's restart")
        wait_until(lambda: serving_count(cfg) == 2, 120, "reward-rm-1 joining the restarted controller")
        status = controller_status((cfg.run_dir / "controller.address").read_text())
        assert dict(status.desired_scorer_replicas) == {"rm": 3}
        assert sorted(r for r in supervised_roles(cfg) if r.startswith("reward-")) == ["reward-rm-0", "reward-rm-1"]
        scale_reward(cfg, 1)
        wait_until(lambda: len(scorer_servers(cfg)) == 1, 120, "one scorer server again")
        code, err = finish(up, tail=10**6)  # the scale lines are far above the last steps' lines
    assert code == 0, err[-3000:]
    assert "scale up: starting reward-rm-1" in err and "scale down: stopping reward-rm-1" in err, err
    assert err.count(REFUSED) == 1 and supervisor_log(cfg).count(REFUSED) == 1, err
    fates = ledger_fates(cfg)
    assert not [pid for pid, f in fates.items() if f.count("trained") > 1]
    # the prompts the killed controller was generating are failed by its restart, as after any controller restart
    events = [json.loads(line) for line in (cfg.run_dir / "controller" / "ledger.jsonl").read_text().splitlines()]
    assert {e["reason"] for e in events if e.get("state") == "failed"} <= {RESTARTED}
    assert sum(f.count("trained") for f in fates.values()) == steps * SHAPE["train_batch_groups"]


def group_advantages(record: dict) -> list[float]:
    """GRPO's advantage of each sample of one samples.jsonl record (one group) from the task rewards it logged."""
    rewards = torch.tensor([x["reward"] for x in record["samples"]])
    return grpo_advantage(rewards, torch.zeros(len(rewards), dtype=torch.long)).tolist()


@pytest.mark.timeout(900)
def test_on_policy_distillation_with_a_task_reward_reads_the_teacher_and_the_reward(
    tmp_path, make_config, tiny_model_dir
):
    """algorithm.advantage: distill with the served teacher `teacher` (item 6), combined with the task reward
    (``distill_task_advantage: grpo``): the controller fetches the teacher's log-probs of every sampled token as each
    group completes, and each token's advantage is its sample's GRPO advantage of the task reward plus
    -(rollout logprob - teacher logprob). The teacher here is the policy's own starting weights, so at step 1 the
    distillation term is float rounding: every sample's advantage (its token mean, in samples.jsonl) is the GRPO
    advantage of its group's logged rewards, the two log-probs of each token agreeing, aligned; the student then
    moves away from the teacher and the advantages leave the task's, as the logged mean reverse KL per token does
    zero. Both terms are in every step's metrics: the task reward and distill/reverse_kl. The task reward is the
    response's length in characters, which tells the untrained model's samples apart (the digits' answers it never
    matches)."""
    (tmp_path / "lengths.py").write_text("def chars(response, answer):\n    return float(len(response))\n")
    steps = 3
    config = make_config(
        "distilled",
        scorers={"teacher": {"kind": "teacher", "model": str(tiny_model_dir), "precision": "float32"}},
        algorithm={"advantage": "distill", "teacher": "teacher", "distill_task_advantage": "grpo"},
        controller={**SHAPE, "reward": {"fn": "lengths:chars"}},
        trainer={"steps": steps, "lr": 0.05},
        rollout={"workers": 1},
        samples={"every": 1, "prompts": 4},
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code, err = finish(start_up(config, env=env))
    cfg = load_config(config)
    assert code == 0, err
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["scorer/teacher/calls"] >= SHAPE["prompts_per_gen_batch"] for r in records)
    assert all(r["rewards/chars"] > 0 and "distill/reverse_kl" in r for r in records)  # the task's term, the teacher's
    lines = [json.loads(line) for line in (cfg.run_dir / "samples.jsonl").read_text().splitlines()]
    logged = {s: [x["advantage"] for r in lines if r["step"] == s for x in r["samples"]] for s in (1, steps)}
    task = {s: [a for r in lines if r["step"] == s for a in group_advantages(r)] for s in (1, steps)}
    assert len(logged[1]) == 16 and logged[1] == pytest.approx(task[1], abs=1e-4), (logged[1], task[1])
    assert max(map(abs, task[1])) > 0.1, task[1]  # the task reward tells samples apart: its term is not zero
    assert max(abs(a - t) for a, t in zip(logged[steps], task[steps])) > 1e-3, (logged[steps], task[steps])
    # distill/reverse_kl, the step's mean reverse KL per token: 0 at the teacher's own weights, then the drift
    kls = [r["distill/reverse_kl"] for r in records]
    assert abs(kls[0]) < 1e-4 and kls[-1] > 1e-3, kls
