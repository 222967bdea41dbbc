"""``relayrl train dpo`` and ``relayrl train rm`` (relayrl/trainer/preference.py, reward_trainer.py) as a user runs
them, on a tiny ChatML Qwen2 and conversational a+b preference pairs (chosen: the sum; rejected: a wrong one):
DPO's loss falls and its metrics carry TRL's names, its reference log-probs are computed once and cached, a run
killed with SIGKILL resumes to the uninterrupted run's weights, the export loads with transformers, bad data is
refused in one line naming the row and column; KTO trains on unpaired rows; the reward model's loss falls, its
held-out pair accuracy beats chance, and its export loads with AutoModelForSequenceClassification and scores the
held-out pairs as the run logged."""

from __future__ import annotations

import json
import random
import signal
import subprocess
from pathlib import Path

import offline_testing
import pytest
import torch
from offline_testing import assert_same_weights, records, refusal, start_until, tiny_chat_model, write_rows
from transformers import AutoModelForCausalLM

from relayrl.config import ConfigError, load_offline_config
from relayrl.data.trl_formats import load_format, render_preferences
from relayrl.rewards.reward_model import load_reward_model, reward_scores

# one xdist worker for the module: the resume test compares against the one uninterrupted run (`dpo_run`)
pytestmark = pytest.mark.xdist_group("train_preference")
STEPS = 6
TRL_METRICS = (
    "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
    "logps/rejected",
)  # fmt: skip


def pair(a: int, b: int, wrong: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": f"{a}+{b}"}],
        "chosen": [{"role": "assistant", "content": f"{a + b}"}],
        "rejected": [{"role": "assistant", "content": f"{wrong} is what I think"}],
    }


def unpaired(a: int, b: int, good: bool) -> dict:
    return {
        "prompt": [{"role": "user", "content": f"{a}+{b}"}],
        "completion": [{"role": "assistant", "content": f"{a + b}" if good else f"{a + b + 1} is what I think"}],
        "label": good,
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The tiny model, 32 training pairs and 12 held-out ones, 24 unpaired training rows and 8 held-out ones."""
    root = tmp_path_factory.mktemp("preference")
    tiny_chat_model(root / "model")
    rng = random.Random(0)
    for name, count in (("train", 32), ("heldout", 12)):
        rows = [pair(rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 18)) for _ in range(count)]
        write_rows(root / f"{name}.jsonl", rows)
    for name, count in (("unpaired", 24), ("unpaired_heldout", 8)):
        write_rows(
            root / f"{name}.jsonl", [unpaired(rng.randint(0, 9), rng.randint(0, 9), i % 2 == 0) for i in range(count)]
        )
    return root


def write_config(root: Path, name: str, steps: int = STEPS, **sections) -> Path:
    data = {"path": str(root / "train.jsonl"), "eval_path": str(root / "heldout.jsonl")}
    return offline_testing.write_config(root, name, steps, data=data, **sections)


@pytest.fixture(scope="module")
def dpo_run(workdir) -> tuple[Path, subprocess.CompletedProcess]:
    """An uninterrupted DPO (sigmoid) run of STEPS steps, reference log-probs precomputed."""
    done = offline_testing.train("dpo", str(write_config(workdir, "dpo", loss={"beta": 0.5})))
    return workdir / "runs" / "dpo", done


def test_dpo_learns_the_preference_and_logs_trl_metrics(dpo_run) -> None:
    run_dir, done = dpo_run
    lines = records(run_dir)
    assert lines[0]["step"] == 0 and set(lines[0]) == {"step", *(f"eval_{key}" for key in TRL_METRICS)}
    assert lines[0]["eval_loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy is the reference: log 2
    steps = lines[1:]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(key in r for r in steps for key in (*TRL_METRICS, "lr", "grad_norm", "tokens"))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.2
    assert steps[-1]["eval_rewards/margins"] > 0.5 and steps[-1]["eval_rewards/accuracies"] > 0.9
    assert f"step {STEPS}/{STEPS} epoch 1 loss" in done.stdout and "held-out loss" in done.stdout
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert len(list((run_dir / "reference_logps").glob("*.pt"))) == 2  # the training and the held-out rows
    AutoModelForCausalLM.from_pretrained(run_dir / "final")  # the export loads


def test_a_killed_dpo_run_resumes_to_the_uninterrupted_weights(dpo_run, workdir) -> None:
    """SIGKILL after step 2's checkpoint, then --resume: the reference log-probs are read back from the cache (the
    policy has trained since) and the weights end as the uninterrupted run's, bit for bit, every step's loss too."""
    run_dir, _ = dpo_run
    config = write_config(workdir, "dpo_killed", loss={"beta": 0.5})
    killed = workdir / "runs" / "dpo_killed"
    proc = start_until("dpo", config, killed, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cached = {path.name: path.stat().st_mtime_ns for path in (killed / "reference_logps").glob("*.pt")}
    assert len(cached) == 2 and not (killed / "final").exists()
    offline_testing.train("dpo", str(config), "--resume")
    assert {path.name: path.stat().st_mtime_ns for path in (killed / "reference_logps").glob("*.pt")} == cached
    assert_same_weights(run_dir / "final", killed / "final")
    assert [r["loss"] for r in records(killed) if r["step"]] == [r["loss"] for r in records(run_dir)[1:]]


def test_bad_preference_data_is_refused_in_one_line(workdir) -> None:
    bad = write_rows(workdir / "bad.jsonl", [pair(1, 2, 5), {**pair(2, 2, 4), "chosen": "4"}])
    config = write_config(workdir, "bad")
    line = refusal("dpo", str(config), "--set", f"data.path={bad}")
    assert "data.path" in line and "row 1, column 'chosen'" in line
    line = refusal("dpo", str(config), "--set", "loss.type=kto")
    assert "data.path" in line and "loss.type kto takes prompt/completion/label" in line
    assert not (workdir / "runs" / "bad").exists()
    with pytest.raises(ConfigError, match=r"loss\.label_smoothing: conservative DPO"):
        load_offline_config("dpo", config, ["loss={type: ipo, label_smoothing: 0.1}"])


def test_kto_on_unpaired_rows_with_a_frozen_reference(workdir) -> None:
    """loss.type kto, the reference a frozen copy on the trainer: z0 (kl) is logged, the loss falls, the held-out
    desirable completions' rewards rise above the undesirable ones' (0 apart before training: the policy is the
    reference)."""
    data = {"path": str(workdir / "unpaired.jsonl"), "eval_path": str(workdir / "unpaired_heldout.jsonl")}
    config = offline_testing.write_config(
        workdir, "kto", 4, data=data, loss={"type": "kto", "beta": 0.5, "reference": "frozen"}
    )
    offline_testing.train("dpo", str(config))
    lines = records(workdir / "runs" / "kto")
    assert lines[0]["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-5) and lines[0]["eval_kl"] >= 0
    assert all(r["kl"] >= 0 for r in lines[1:])
    assert lines[-1]["loss"] < lines[1]["loss"]
    assert lines[-1]["eval_rewards/margins"] > 0.1
    assert not (workdir / "runs" / "kto" / "reference_logps").exists()


def heldout_scores(directory: Path, workdir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores of the held-out pairs by the reward model ``from_pretrained`` loads from
    ``directory``: one right-padded batch, as a user scores with transformers."""
    model, tok = load_reward_model(directory)
    rows, _ = load_format(str(workdir / "heldout.jsonl"))
    sequences = [
        s for e in render_preferences(rows, tok) for s in (e.prompt_ids + e.chosen_ids, e.prompt_ids + e.rejected_ids)
    ]
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        scores = reward_scores(model, ids, mask)
    return scores[0::2], scores[1::2]


def test_reward_model_learns_and_its_export_scores_as_the_run_logged(workdir) -> None:
    """train rm: the loss falls, held-out pair accuracy > 0.5 (chance), and the export, loaded with
    AutoModelForSequenceClassification, scores the held-out pairs to the run's last eval_accuracy and eval_margin."""
    config = write_config(workdir, "rm", loss={"center_rewards_coefficient": 0.01})
    offline_testing.train("rm", str(config), "--set", "trainer.lr=1e-2")
    lines = records(workdir / "runs" / "rm")
    assert lines[0]["step"] == 0 and {"eval_accuracy", "eval_margin", "eval_loss"} <= set(lines[0])
    steps = lines[1:]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.1
    assert steps[-1]["eval_accuracy"] > 0.5
    final = workdir / "runs" / "rm" / "final"
    config_json = json.loads((final / "config.json").read_text())
    assert config_json["architectures"] == ["Qwen2ForSequenceClassification"]
    chosen, rejected = heldout_scores(final, workdir)
    assert float((chosen > rejected).float().mean()) == pytest.approx(steps[-1]["eval_accuracy"])
    assert float((chosen - rejected).mean()) == pytest.approx(steps[-1]["eval_margin"], abs=1e-5)
    assert (workdir / "runs" / "rm" / "metrics.png").stat().st_size > 0
