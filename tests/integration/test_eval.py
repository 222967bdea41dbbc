"""Held-out evaluation through ``relayrl up``, one real run shared by every assertion: at K = 1 with in-flight weight
updates (``rollout.partial: keep_kv``), each eval measures one policy version while training goes on; evals,
samples and the rollout-correction diagnostics reach TensorBoard; the readable samples of training and eval are
written and ``relayrl samples`` prints them; the best version by an eval metric is kept as ``best``; ``relayrl
eval`` on a checkpoint of that run reproduces its greedy in-run eval exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import load_config
from relayrl.trainer.metrics import read_evals

from .jobs import contiguous_records, finish, running_up

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 6, 2


def cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *argv], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def relayrl(*argv: str) -> str:
    return cli(*argv).stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, digits_path):
    """6 steps at K = 1 from one worker fed one prompt per call, responses up to 48 tokens (EOS sampled freely) so
    that every weight update lands while rows generate; a greedy eval of the ten held-out prompts (48 tokens each)
    at versions 0, 2, 4 and 6; samples every 2 steps; a checkpoint every 2 steps."""
    tmp = tmp_path_factory.mktemp("eval")
    config = {
        "run": {"name": "eval", "dir": str(tmp / "runs"), "seed": 0},
        "model": {"path": str(tiny_model_dir)},
        "data": {"path": str(digits_path)},
        "rollout": {"workers": 1, "n": 8, "max_tokens": 48, "partial": "keep_kv"},
        "controller": {
            "max_staleness": 1, "dynamic_sampling": False, "dispatch_chunk": 1, "worker_max_calls": 2,
            "prompts_per_gen_batch": 4, "train_batch_groups": 4, "reward": {"fn": "prefix_match"},
        },
        "trainer": {
            "steps": STEPS, "nproc": 1, "lr": 0.003, "mini_batches": 1, "checkpoint_every": EVERY,
            "tensorboard": True,
        },
        "algorithm": {"old_logprobs": "rollout"},
        "weight_sync": {"bucket_mib": 1, "timeout_s": 30},
        "eval": {
            "sets": {"heldout": {"path": "builtin:digits-heldout"}}, "every": EVERY,
            "best": {"metric": "heldout/mean@1"},
        },
        "samples": {"every": EVERY, "prompts": 2},
    }  # fmt: skip
    path = tmp / "eval.yaml"
    path.write_text(json.dumps(config))
    with running_up(path) as up:
        code, err = finish(up)
    assert code == 0, err
    return path, load_config(path)


def test_each_eval_under_k1_with_in_flight_updates_measures_one_version_and_training_goes_on(run) -> None:
    _, cfg = run
    steps = {r["step"]: r for r in contiguous_records(cfg, STEPS)}
    # training went on asynchronously: steps trained tokens older than their starting weights (K = 1) or rows that
    # lived through a weight update (in flight)
    assert any(r["stale_token_share"] > 0 or r["mixed_version_samples"] > 0 for r in steps.values())
    evals = read_evals(cfg.run_dir / "metrics.jsonl")
    assert [(e["eval"], e["step"]) for e in evals] == [("heldout", v) for v in range(0, STEPS + 1, EVERY)]
    assert all(e["policy_version"] == e["step"] and e["prompts"] == 10 and e["prompts_failed"] == 0 for e in evals)
    assert all({"mean@1", "pass@1", "response_len_mean", "truncated_frac"} <= set(e) for e in evals)
    generations = [json.loads(line) for line in (cfg.run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted({g["step"] for g in generations}) == [0, 2, 4, 6] and len(generations) == 40
    assert all(s["versions"] == [g["step"]] for g in generations for s in g["samples"])  # one version, every token
    for e in evals[:-1]:  # the update after an eval's version waited for it: the eval ended before that step did
        assert e["time"] <= steps[e["step"] + 1]["time"]
    assert (cfg.run_dir / "reward.png").stat().st_size > 0
    best = json.loads((cfg.run_dir / "best" / "best.json").read_text())  # the first version with the top mean@1
    top = max(e["mean@1"] for e in evals)
    assert best["value"] == top and best["step"] == next(e["step"] for e in evals if e["mean@1"] == top)
    assert (cfg.run_dir / "best" / "config.json").is_file() and not (cfg.run_dir / "candidates").exists()


def test_evals_samples_and_rollout_correction_diagnostics_reach_tensorboard(run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, cfg = run
    events = EventAccumulator(str(cfg.run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    evals = read_evals(cfg.run_dir / "metrics.jsonl")
    scalars = events.Scalars("eval/heldout/mean@1")  # at the version each eval measured
    assert [(e.step, e.value) for e in scalars] == [(r["step"], pytest.approx(r["mean@1"])) for r in evals]
    assert "samples/text_summary" in events.Tags()["tensors"]  # the readable samples, as a markdown table
    records = contiguous_records(cfg, STEPS)  # each step's rollout-correction diagnostics, as in metrics.jsonl
    for name in ("kl_k3", "ess", "rejected_token_share", "is_weight_mean"):
        values = [(e.step, e.value) for e in events.Scalars(f"rollout_corr/{name}")]
        assert values == [(r["step"], pytest.approx(r[f"rollout_corr/{name}"], rel=1e-6)) for r in records], name


def test_the_run_writes_readable_samples_and_relayrl_samples_prints_them_even_into_a_closed_pipe(run) -> None:
    _, cfg = run
    records = [json.loads(line) for line in (cfg.run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in records}) == [1, 2, 4, 6]
    assert all(len([r for r in records if r["step"] == s]) == 2 for s in (1, 2, 4, 6))  # 2 prompts a step
    for record in records:
        assert record["prompt"].endswith("=") and len(record["samples"]) == 8
        digit = int(record["prompt"].split("+")[0])  # "d + 1 =": the user's prompt, with its row's answer
        assert record["answer"] == str((digit + 1) % 10) and "rendered_prompt" in record
        rewards = [s["reward"] for s in record["samples"]]
        advantages = [s["advantage"] for s in record["samples"]]
        assert all(
            isinstance(s["response"], str) and s["finish_reason"] in ("stop", "length") for s in record["samples"]
        )
        assert abs(sum(advantages)) < 1e-4 and (max(rewards) > min(rewards)) == any(abs(a) > 0 for a in advantages)
    printed = relayrl("samples", "--run", str(cfg.run_dir))
    last = [r for r in records if r["step"] == STEPS]
    assert "== training step 6" in printed and "== eval heldout at version 6" in printed
    assert all(repr(r["prompt"]) in printed and repr(r["samples"][0]["response"]) in printed for r in last)
    assert all(f"{r['prompt']!r} (answer {r['answer']!r})" in printed for r in last)
    assert f"advantage {last[0]['samples'][0]['advantage']:+.3f}" in printed
    assert json.loads(relayrl("samples", "--run", str(cfg.run_dir), "--step", "2", "--json"))[0]["step"] == 2
    # `relayrl samples | head`: the reader leaves before the print; one exit status, no traceback
    reader_gone = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "samples", "--run", str(cfg.run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    reader_gone.stdout.close()
    assert reader_gone.wait(timeout=60) == 128 + signal.SIGPIPE and reader_gone.stderr.read() == ""


@pytest.mark.parametrize(("checkpoint", "version"), [("checkpoints/step_4", []), ("final", ["--version", "6"])])
def test_relayrl_eval_of_a_checkpoint_reproduces_the_greedy_in_run_eval_exactly(run, checkpoint, version) -> None:
    """A trainer checkpoint (converted, labelled with its step) and the run's Hugging Face export (final: the last
    step's weights; an export says no version, --version labels it) score exactly as the run scored them."""
    path, cfg = run
    argv = ["eval", str(path), "--checkpoint", str(cfg.run_dir / checkpoint), "--generations", *version]
    done = cli(*argv)
    report = json.loads(done.stdout)
    step = int(version[1]) if version else 4
    assert f"eval heldout at version {step}:" in done.stderr and "at version 0" not in done.stderr  # as the JSON
    in_run = next(e for e in read_evals(cfg.run_dir / "metrics.jsonl") if e["step"] == step)
    result = report["results"]["heldout"]
    assert report["policy_version"] == result["step"] == step
    metrics = [k for k in in_run if "@" in k or k in ("response_len_mean", "truncated_frac")]
    assert {k: result[k] for k in metrics} == {k: in_run[k] for k in metrics}
    generations = [json.loads(line) for line in (cfg.run_dir / "eval_samples.jsonl").read_text().splitlines()]
    responses = {g["prompt_id"]: [s["response"] for s in g["samples"]] for g in generations if g["step"] == step}
    assert {g["prompt_id"]: [s["response"] for s in g["samples"]] for g in report["generations"]["heldout"]} == (
        responses
    )
