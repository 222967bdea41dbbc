"""``relayrl train sft`` (relayrl/trainer/sft.py) as a user runs it, on a tiny ChatML Qwen2: the loss falls, the
export loads with ``from_pretrained`` and scores the held-out rows as the run logged, bad data and unknown keys are
refused in one line (exit 2), a run stopped by SIGTERM (exit 0) and killed with SIGKILL resumes to the
uninterrupted run's weights, two FSDP2 ranks train to one rank's weights, and LoRA trains under bf16 compute. Also
the step plan and the packed rows' attention under the CPU's float32 SDPA."""

from __future__ import annotations

import json
import random
import signal
import subprocess
from pathlib import Path

import offline_testing
import pytest
import torch
import yaml
from cli_testing import relayrl_run
from offline_testing import assert_same_weights, records, tiny_chat_model, write_rows
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.algorithms.sft_loss import pack_examples, pad_examples
from relayrl.config import TrainerConfig
from relayrl.trainer.precision import FLOAT32_SDPA, Precision
from relayrl.trainer.sft_plan import pack_rows, plan_steps

# one xdist worker for the module: four tests compare against the one uninterrupted run (`finished`)
pytestmark = pytest.mark.xdist_group("train_sft")
STEPS = 8


def chat_row(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": f"{a + b}"}]}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A tiny ChatML Qwen2 (hidden 32, 2 layers), 40 training rows and 10 held-out ones of a+b."""
    root = tmp_path_factory.mktemp("sft")
    tiny_chat_model(root / "model")
    rng = random.Random(0)
    for name, count in (("train", 40), ("heldout", 10)):
        write_rows(root / f"{name}.jsonl", [chat_row(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(count)])
    return root


def write_config(root: Path, name: str, **data) -> Path:
    data = {"path": str(root / "train.jsonl"), "eval_path": str(root / "heldout.jsonl"), **data}
    return offline_testing.write_config(root, name, STEPS, data=data)


def train(*argv: str) -> subprocess.CompletedProcess:
    return offline_testing.train("sft", *argv)


def refusal(*argv: str) -> str:
    return offline_testing.refusal("sft", *argv)


def start_until(config: Path, run_dir: Path, step: int, *extra: str) -> subprocess.Popen:
    return offline_testing.start_until("sft", config, run_dir, step, *extra)


@pytest.fixture(scope="module")
def finished(workdir) -> tuple[Path, subprocess.CompletedProcess]:
    """An uninterrupted run of STEPS steps."""
    done = train(str(write_config(workdir, "whole")))
    return workdir / "runs" / "whole", done


def test_the_loss_falls_and_the_run_writes_its_files(finished) -> None:
    run_dir, done = finished
    lines = records(run_dir)
    assert lines[0]["step"] == 0 and set(lines[0]) == {"step", "eval_loss", "eval_token_accuracy"}
    steps = lines[1:]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for key in ("loss", "token_accuracy", "lr", "grad_norm", "tokens", "epoch"):
        assert all(key in r for r in steps), key
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3
    assert steps[-1]["eval_loss"] < lines[0]["eval_loss"] - 0.3  # held out: the rows it never trained on
    assert steps[0]["lr"] == pytest.approx(3e-3) and steps[-1]["lr"] < steps[0]["lr"]  # linear decay by default
    assert f"step {STEPS}/{STEPS} epoch 1 loss" in done.stdout and "held-out loss" in done.stdout
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["steps"] == STEPS


def heldout_loss(directory: Path, workdir: Path) -> float:
    """The token-mean NLL of the model ``from_pretrained`` loads from ``directory`` on the held-out rows, float32,
    each example in its own padded row."""
    from relayrl.data.trl_formats import load_format, render_sft

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(directory)
    rows, _ = load_format(str(workdir / "heldout.jsonl"))
    batch = pad_examples([(e.input_ids, e.loss_mask) for e in render_sft(rows, tok)], tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.input_ids[:, 1:], reduction="none")
    return float((nll * batch.target_mask).sum() / batch.target_mask.sum())


def test_the_export_loads_and_scores_the_heldout_rows_as_the_run_logged(finished, workdir) -> None:
    """The exported model's held-out loss, each example in its own padded row, is the run's last eval_loss
    (computed packed, by the trainer's weights)."""
    run_dir, _ = finished
    assert heldout_loss(run_dir / "final", workdir) == pytest.approx(records(run_dir)[-1]["eval_loss"], abs=1e-5)


def test_lora_under_bf16_compute_trains_and_exports_the_adapter_and_the_merged_model(workdir) -> None:
    """model.lora with trainer.precision bfloat16 (float32 adapter weights, bf16 matmuls, float32 SDPA on a CPU):
    the held-out loss falls, final/adapter is a PEFT adapter, final/merged loads with from_pretrained and scores the
    held-out rows as the run's last eval_loss to bf16 rounding."""
    lora = "model.lora={rank: 8, alpha: 16, export_merged: true}"
    config = write_config(workdir, "lora")
    train(str(config), "--set", lora, "--set", "trainer.precision=bfloat16", "--set", "trainer.lr=2e-2")
    run_dir = workdir / "runs" / "lora"
    lines = records(run_dir)
    assert lines[-1]["eval_loss"] < lines[0]["eval_loss"] - 0.1
    assert json.loads((run_dir / "final" / "adapter" / "adapter_config.json").read_text())["r"] == 8
    assert heldout_loss(run_dir / "final" / "merged", workdir) == pytest.approx(lines[-1]["eval_loss"], abs=0.05)


def test_a_run_stopped_by_sigterm_then_killed_resumes_to_the_uninterrupted_weights(finished, workdir) -> None:
    """SIGTERM: the step in progress ends, is checkpointed, exit 0; then --resume, SIGKILL mid-run, --resume: the
    weights are the uninterrupted run's bit for bit, and so is every step's loss."""
    run_dir, _ = finished
    config = write_config(workdir, "killed")
    killed = workdir / "runs" / "killed"
    proc = start_until(config, killed, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=240) == 0, proc.stderr_text()[-3000:]
    stopped_at = records(killed)[-1]["step"]
    assert (killed / "checkpoints" / f"step_{stopped_at}" / "trainer_state.json").exists()
    assert stopped_at < STEPS and not (killed / "final").exists()
    proc = start_until(config, killed, stopped_at + 2, "--resume")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists()
    code, _, stderr = relayrl_run("train", "sft", str(config))
    assert code == 2 and "--resume continues it" in stderr
    line = refusal(str(config), "--resume", "--set", "trainer.batch_tokens=300", "--set", "trainer.eval_every=2")
    assert "trainer.batch_tokens (200 in the run, 300 now)" in line and "eval_every" not in line.split(";")[0]
    train(str(config), "--resume")
    assert_same_weights(run_dir / "final", killed / "final")
    assert [r["loss"] for r in records(killed)[1:]] == [r["loss"] for r in records(run_dir)[1:]]


def test_two_ranks_train_to_the_one_rank_weights(finished, workdir) -> None:
    """trainer.nproc 2: torchrun starts two FSDP2 ranks (gloo), each forwards every other packed row of a step (3
    rows a step here: one rank makes an idle forward), the loss scaled by the ranks: the same losses and weights as
    one rank, to float rounding."""
    run_dir, _ = finished
    train(str(write_config(workdir, "two")), "--set", "trainer.nproc=2")
    two = workdir / "runs" / "two"
    assert [r["loss"] for r in records(two)[1:]] == pytest.approx([r["loss"] for r in records(run_dir)[1:]], rel=1e-6)
    assert all(r["rows"] >= 2 for r in records(two)[1:])
    one, both = load_file(run_dir / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    for name in one:
        torch.testing.assert_close(both[name], one[name], atol=1e-6, rtol=0)


def test_bad_data_and_unknown_keys_are_refused_in_one_line(workdir) -> None:
    bad = workdir / "bad.jsonl"
    bad.write_text(json.dumps(chat_row(1, 2)) + "\n" + json.dumps({"messages": "1+2=3"}) + "\n")
    config = write_config(workdir, "bad")
    line = refusal(str(config), "--set", f"data.path={bad}")
    assert "data.path" in line and "row 1, column 'messages'" in line
    assert refusal(str(config), "--set", "trainer.stream=on") == "relayrl: config error: trainer.stream: unknown key"
    assert not (workdir / "runs" / "bad").exists()


def test_steps_fill_the_token_budget_and_rows_the_pack_budget() -> None:
    lengths = [30, 50, 20, 80, 10, 300, 40]
    plan = plan_steps(lengths, batch_tokens=100, epochs=2, steps=None, seed=0, shuffle=True)
    for epoch in (0, 1):
        visited = [i for e, step in plan if e == epoch for i in step]
        assert sorted(visited) == list(range(len(lengths)))  # every example once per epoch
    for _, step in plan:
        assert sum(lengths[i] for i in step) <= 100 or len(step) == 1  # the 300-token example goes alone
        rows = pack_rows(lengths, step, 60)
        assert sorted(i for row in rows for i in row) == sorted(step)
        assert all(sum(lengths[i] for i in row) <= 60 or len(row) == 1 for row in rows)
    assert plan == plan_steps(lengths, batch_tokens=100, epochs=2, steps=None, seed=0, shuffle=True)
    capped = plan_steps(lengths, batch_tokens=100, epochs=1, steps=len(plan) + 2, seed=0, shuffle=True)
    assert len(capped) == len(plan) + 2 and capped[: len(plan)] == plan  # steps past the epochs: more passes


def test_packed_examples_do_not_attend_across_under_float32_sdpa(workdir) -> None:
    """Under bf16 compute on a CPU the trained model's attention is FLOAT32_SDPA (trainer/precision.py): its mask
    function must be SDPA's, or transformers gives it no mask and a packed row's examples see each other."""
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32)
    Precision.resolve(TrainerConfig(precision="bfloat16"), "auto", torch.device("cpu")).prepare(
        model, torch.device("cpu")
    )
    assert model.config._attn_implementation == FLOAT32_SDPA
    examples = [([5, 9, 12, 7], [0, 1, 1, 1]), ([3, 4, 8], [0, 1, 1]), ([6, 2, 11, 10, 13], [0, 0, 1, 1, 1])]
    packed = pack_examples(examples)
    with torch.no_grad():  # float32 inputs, no autocast: FLOAT32_SDPA computes as SDPA does
        together = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[0]
        start = 0
        for ids, _ in examples:
            alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            torch.testing.assert_close(together[start : start + len(ids)], alone, atol=1e-5, rtol=1e-5)
            start += len(ids)


def write_eval_config(workdir: Path, name: str, rows: list[dict], with_eval: bool = True) -> Path:
    """An RL config (``relayrl up``'s) whose eval set holds ``rows`` as prompt/answer rows, scored by exact_match."""
    prompts = workdir / "eval-prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": r["messages"][0]["content"], "answer": r["messages"][1]["content"]}) + "\n"
            for r in rows
        )
    )
    config = {
        "model": {"path": str(workdir / "model")},
        "data": {"path": str(prompts)},
        "rollout": {"workers": 1, "max_tokens": 4},
        "controller": {"reward": {"fn": "exact_match"}},
        **({"eval": {"sets": {"sums": {"path": str(prompts)}}}} if with_eval else {}),
    }
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_rl_eval_sets_score_the_checkpoints_on_a_rollout_worker(workdir) -> None:
    """An eval section naming an RL config: before step 1 and at each eval step the weights are scored by ``relayrl
    eval`` (greedy, a rollout worker process) and the sets' lines land in metrics.jsonl as ``relayrl up`` writes
    them, and in metrics.png. Trained on the very rows the set asks, all of them summing to 7 (it measures the
    checkpoint, not generalisation), the greedy accuracy climbs from the random model's 0."""
    rows = [chat_row(a, 7 - a) for a in range(5)]
    train_path = workdir / "memorise.jsonl"
    train_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config, rl_config = write_config(workdir, "rl-eval"), write_eval_config(workdir, "up-sums", rows)
    sets = [f"data.path={train_path}", "data.eval_path=null", f"eval.config={rl_config}"]
    sets += ["trainer.steps=30", "trainer.lr=1e-2", "trainer.lr_schedule=constant", "trainer.checkpoint_every=0"]
    done = train(str(config), *(arg for s in sets for arg in ("--set", s)))
    run_dir = workdir / "runs" / "rl-eval"
    evals = [r for r in records(run_dir) if "eval" in r]
    assert [(r["eval"], r["step"], r["prompts"]) for r in evals] == [("sums", s, 5) for s in (0, 30)]
    assert evals[0]["mean@1"] == 0.0 and evals[-1]["mean@1"] == 1.0, evals
    assert "step 30 eval sums: mean@1 1.000" in done.stdout
    assert not (run_dir / "eval_weights").exists() and (run_dir / "metrics.png").stat().st_size > 0


def test_an_eval_config_without_eval_sets_is_refused_naming_the_key(workdir) -> None:
    config = write_config(workdir, "rl-eval-bad")
    rl_config = write_eval_config(workdir, "up-no-eval", [chat_row(1, 2)], with_eval=False)
    line = refusal(str(config), "--set", f"eval.config={rl_config}")
    assert line.startswith(f"relayrl: config error: eval.config {rl_config}: the config has no eval section"), line
    assert not (workdir / "runs" / "rl-eval-bad").exists()
