"""The TRL side of ``relayrl bench e2e``: TRL's ``GRPOTrainer`` on CPU, run as its own process.

``python -m relayrl.bench.trl_runner SPEC.json`` reads a spec written by ``relayrl.bench.e2e`` (model
directory, JSONL data, batch shape, sampling and loss settings, all taken from the same relayrl config
the relayrl side runs) and appends one JSON line per generation round to ``spec["metrics_path"]``, in
the keys of relayrl's ``metrics.jsonl``: ``step`` (generation round), ``time`` (epoch seconds at its
end), ``step_seconds``, ``generation_seconds`` (inside ``GRPOTrainer._generate``), ``train_seconds``
(the rest of the round: scoring, old log-probs, forward/backward, optimizer steps),
``samples_generated``, ``response_len_mean``, ``reward_mean`` and ``paused_seconds`` (below).

With ``spec["score"]`` (``relayrl bench tta``) TRL saves a checkpoint every ``score["every"]`` rounds and the
run scores it there, paused, with relayrl's own eval (``relayrl eval CONFIG --checkpoint DIR``: the same held-out set,
greedy sampling and scoring code as relayrl's in-run evals); each score is appended to the metrics file as an eval
line in relayrl's form (``eval``, ``step`` = the round, the metric), the checkpoint is deleted, and training stops
once the metric reaches ``score["target"]``. ``paused_seconds``: the seconds spent saving and scoring before the
round's end, which are not TRL's training (its net clock is ``time - paused_seconds``).

One round = ``prompts_per_step`` prompts x ``n`` samples, trained in ``mini_batches`` optimizer steps
(TRL: ``steps_per_generation``), as relayrl's step trains one batch in ``trainer.mini_batches`` steps.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from relayrl.config import DataConfig
from relayrl.data.dataset import load_rows
from relayrl.data.prompts import NO_TEMPLATE_FOR_SYSTEM, template_fields
from relayrl.rewards import resolve_reward


class RoundLog:
    """What one generation round measured, filled by the reward function, ``_generate`` and the callback."""

    def __init__(self, metrics_path: Path, mini_batches: int) -> None:
        self.metrics_path = metrics_path
        self.mini_batches = mini_batches
        self.round = 0
        self.round_started = 0.0
        self.generation_seconds = 0.0
        self.rewards: list[float] = []
        self.lengths: list[int] = []
        self.paused_seconds = 0.0  # saving and scoring checkpoints, in all
        self.round_paused = 0.0  # ... in the current round

    def pause(self, seconds: float) -> None:
        self.paused_seconds += seconds
        self.round_paused += seconds

    def append(self, record: dict) -> None:
        with self.metrics_path.open("a") as out:
            out.write(json.dumps(record) + "\n")

    def end_round(self, now: float) -> None:
        step_seconds = now - self.round_started - self.round_paused
        self.round += 1
        record = {
            "step": self.round,
            "time": time.time(),
            "step_seconds": step_seconds,
            "generation_seconds": self.generation_seconds,
            "train_seconds": step_seconds - self.generation_seconds,
            "samples_generated": len(self.rewards),
            "response_len_mean": sum(self.lengths) / max(1, len(self.lengths)),
            "response_len_min": min(self.lengths, default=0),
            "reward_mean": sum(self.rewards) / max(1, len(self.rewards)),
            "paused_seconds": self.paused_seconds,
        }
        self.append(record)
        self.round_started, self.generation_seconds, self.round_paused = now, 0.0, 0.0
        self.rewards, self.lengths = [], []


class RoundTimer(TrainerCallback):
    """Closes a round after every ``mini_batches``-th optimizer step (TRL generates once per that many)."""

    def __init__(self, log: RoundLog) -> None:
        self.log = log

    def on_train_begin(self, args, state, control, **kwargs):
        self.log.round_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.log.mini_batches == 0:
            self.log.end_round(time.perf_counter())


class ScoreCheckpoints(TrainerCallback):
    """After each checkpoint save: ``relayrl eval`` of it (``score``: module docstring), its metric appended as an
    eval line, the checkpoint deleted, training stopped at the target; the seconds are the round log's pauses."""

    def __init__(self, log: RoundLog, score: dict) -> None:
        self.log, self.score = log, score

    def on_save(self, args, state, control, **kwargs):
        began = time.perf_counter()
        version = state.global_step // self.log.mini_batches
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        value = score_checkpoint(self.score, checkpoint, version)
        shutil.rmtree(checkpoint, ignore_errors=True)
        self.log.append({"eval": self.score["set"], "step": version, self.score["metric"]: value,
                         "eval_seconds": time.perf_counter() - began, "time": time.time()})  # fmt: skip
        self.log.pause(time.perf_counter() - began)
        if value >= self.score["target"]:
            control.should_training_stop = True
        return control


def score_checkpoint(score: dict, checkpoint: Path, version: int) -> float:
    """``score["metric"]`` of ``score["set"]`` in ``relayrl eval``'s report on ``checkpoint`` (``score["argv"]``:
    the command up to its ``--checkpoint``)."""
    report = checkpoint.parent / f"eval-{version}.json"
    argv = [*score["argv"], "--checkpoint", str(checkpoint), "--version", str(version), "--out", str(report)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"relayrl eval of {checkpoint} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(report.read_text())["results"][score["set"]][score["metric"]]


class TimedGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that adds the time spent in ``_generate`` to the current round, and the time spent saving a
    checkpoint to the run's pauses."""

    round_log: RoundLog

    def _generate(self, prompts: list):
        began = time.perf_counter()
        try:
            return super()._generate(prompts)
        finally:
            self.round_log.generation_seconds += time.perf_counter() - began

    def _save_checkpoint(self, model, trial):
        began = time.perf_counter()
        try:
            return super()._save_checkpoint(model, trial)
        finally:
            self.round_log.pause(time.perf_counter() - began)


def make_reward(name: str, log: RoundLog):
    """TRL reward function over relayrl's reward ``fn(response, answer)``; records rewards and lengths."""
    fn = resolve_reward(name)

    def reward(prompts, completions, answer, completion_ids, **_: Any) -> list[float]:
        values = [fn(completion_text(c), ref) for c, ref in zip(completions, answer)]
        log.rewards += values
        log.lengths += [len(ids) for ids in completion_ids]
        return values

    reward.__name__ = name
    return reward


def completion_text(completion: str | list[dict]) -> str:
    """A completion's text: TRL passes a conversational prompt's completion as its assistant messages."""
    if isinstance(completion, str):
        return completion
    return "".join(message["content"] for message in completion)


def training_rows(spec: dict, tokenizer):
    """The JSONL rows as TRL's ``prompt``/``answer`` columns, the prompt as relayrl renders it: ``prompt_template``
    filled from the row's columns (else its prompt column), conversational when relayrl would template, after a
    system turn when ``system_prompt`` is set."""
    data = DataConfig(path=spec["data_path"], prompt_key=spec["prompt_key"], answer_key=spec["answer_key"])
    template = spec.get("prompt_template")
    fields = template_fields(template) if template is not None else [data.prompt_key]
    rows = load_rows(data).select_columns(list(dict.fromkeys([*fields, data.answer_key])))
    mode = spec["chat_template"]
    templated = mode == "always" or (mode == "auto" and getattr(tokenizer, "chat_template", None))
    system = spec.get("system_prompt")
    if system is not None and not templated:
        raise ValueError(NO_TEMPLATE_FOR_SYSTEM)
    system_turn = [{"role": "system", "content": system}] if system is not None else []

    def convert(row: dict) -> dict:
        text = template.format(**{name: row[name] for name in fields}) if template else str(row[data.prompt_key])
        prompt = [*system_turn, {"role": "user", "content": text}] if templated else text
        return {"prompt": prompt, "answer": str(row[data.answer_key])}

    return rows.map(convert, remove_columns=rows.column_names)


def grpo_config(spec: dict) -> GRPOConfig:
    """relayrl's settings in TRL's terms (no gradient checkpointing, as relayrl trains; float32, or TRL's mixed
    precision when ``spec["bf16"]``)."""
    generation_kwargs = {"min_new_tokens": spec["max_tokens"]} if spec["equal_work"] else None
    per_step = spec["prompts_per_step"] * spec["n"]
    score = spec.get("score")
    saving = {"save_strategy": "no"}
    if score:  # the model's weights alone: no optimizer state is read back
        every = score["every"] * spec["mini_batches"]
        saving = {"save_strategy": "steps", "save_steps": every, "save_only_model": True}
    return GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=True,
        bf16=spec.get("bf16", False),
        fp16=False,
        gradient_checkpointing=False,
        seed=spec["seed"],
        max_steps=spec["steps"] * spec["mini_batches"],
        per_device_train_batch_size=per_step // spec["mini_batches"],
        gradient_accumulation_steps=1,
        steps_per_generation=spec["mini_batches"],
        num_generations=spec["n"],
        max_completion_length=spec["max_tokens"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        generation_kwargs=generation_kwargs,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        weight_decay=spec["weight_decay"],
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        max_grad_norm=spec["grad_clip"],
        loss_type="dapo",
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        beta=0.0,
        num_iterations=1,
        use_transformers_continuous_batching=spec.get("continuous_batching", False),
        scale_rewards="group",
        report_to="none",
        **saving,
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def run(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    log = RoundLog(Path(spec["metrics_path"]), spec["mini_batches"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    callbacks: list[TrainerCallback] = [RoundTimer(log)]
    if spec.get("score"):
        callbacks.append(ScoreCheckpoints(log, spec["score"]))
    trainer = TimedGRPOTrainer(
        model=spec["model_path"],
        reward_funcs=[make_reward(spec["reward_fn"], log)],
        args=grpo_config(spec),
        train_dataset=training_rows(spec, tokenizer),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.round_log = log
    compute = "bfloat16" if spec["bf16"] else "float32"  # bf16=True: autocast over float32 weights
    attention = getattr(trainer.model.config, "_attn_implementation", None)
    print(f"trl model: {attention} attention, {compute} compute", file=sys.stderr, flush=True)  # bench/record.py
    trainer.train()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m relayrl.bench.trl_runner SPEC.json", file=sys.stderr)
        return 2
    run(json.loads(Path(args[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
