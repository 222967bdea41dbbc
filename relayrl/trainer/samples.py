"""Samples you can read (``samples``): every ``every`` steps (and at the first), the batch's first ``prompts``
groups, each with its prompt as the user wrote it and its answer (``Batch.prompts``; a batch without them: the
rendered prompt), the prompt as the model saw it (``rendered_prompt``: chat template and all), and each sample with
its response, reward, advantage, finish reason and policy version, one JSON line per group in
``<run dir>/samples.jsonl`` (rank 0). An episode's response is decoded with its template's special tokens: its
turns (the environment's observations included) read as the model saw them. ``relayrl samples`` prints the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from relayrl.config import SamplesConfig
from relayrl.data.readable import cut, finish_name
from relayrl.runtime.files import atomic_write
from relayrl.v1 import controller_pb2


def step_samples(
    batch: controller_pb2.Batch, step: int, tokenizer, advantages: Sequence[float], scfg: SamplesConfig
) -> list[dict]:
    """The records of step ``step``'s first ``scfg.prompts`` groups. ``advantages``: the step's own, one per sample
    in batch order (relayrl/trainer/step.py ``sample_advantages``: GAE's token advantages meaned over the sample's
    loss tokens), never recomputed here."""
    samples = list(batch.samples)
    if len(advantages) != len(samples):
        raise ValueError(f"advantages: {len(advantages)} for the batch's {len(samples)} samples")
    texts = {p.group: p for p in batch.prompts}  # the user's prompt and answer (the controller's, by group)
    records: dict[int, dict] = {}
    for sample, advantage in zip(samples, advantages):
        if sample.group not in records:
            if len(records) == scfg.prompts:
                continue
            rendered = cut(tokenizer.decode(list(sample.prompt_token_ids), skip_special_tokens=False), scfg.max_chars)
            given = texts.get(sample.group)
            records[sample.group] = {
                "kind": "train", "step": step, "prompt_id": sample.prompt_id,
                "prompt": cut(given.text, scfg.max_chars) if given is not None else rendered,
                **({"answer": given.answer} if given is not None else {}),
                "rendered_prompt": rendered, "samples": [],
            }  # fmt: skip
        episode = bool(sample.loss_mask)
        response = tokenizer.decode(list(sample.response_token_ids), skip_special_tokens=not episode)
        records[sample.group]["samples"].append(
            {
                "response": cut(response, scfg.max_chars),
                "reward": sample.reward,
                "score": sample.score,
                "advantage": advantage,
                "finish_reason": finish_name(sample.finish_reason),
                "policy_version": sample.policy_version,
            }
        )
    return list(records.values())


class SamplesWriter:
    """Appends the records of every ``every``-th step to ``<run dir>/samples.jsonl``; on resume, drops lines past the
    resumed step (as metrics.jsonl)."""

    def __init__(self, path: Path, scfg: SamplesConfig, *, resume_step: int = 0) -> None:
        self.path, self.cfg = path, scfg
        lines = path.read_text().splitlines() if resume_step and path.exists() else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= resume_step]
        atomic_write(path, "".join(line + "\n" for line in kept))
        self._file = path.open("a", buffering=1)

    def due(self, step: int) -> bool:
        return step == 1 or step % self.cfg.every == 0

    def write(self, records: list[dict]) -> None:
        self._file.writelines(json.dumps(r) + "\n" for r in records)

    def close(self) -> None:
        self._file.close()
