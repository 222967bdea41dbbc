"""``relayrl train rm``: a reward model trained on preference pairs, a stage of the offline loop
(relayrl/trainer/offline.py).

The model is the base checkpoint as a one-label sequence classifier (``AutoModelForSequenceClassification`` with
``num_labels`` 1 and the tokenizer's pad token, its ``score`` head fresh under ``run.seed``; TRL's RewardTrainer
builds the same), trained by the FSDP backend like any policy. A packed row of pairs is one right-padded batch of
its chosen and rejected sequences (prompt + completion), scored as transformers' classifier scores: the head's
output at each sequence's last token that is not the pad token (``reward_scores``), so the exported model scores
what the trainer did. The loss is the Bradley–Terry loss (relayrl/algorithms/reward_loss.py) with the pair's
margin column (``loss.margin``) and ``loss.center_rewards_coefficient``; a step's loss is the mean over its pairs.

metrics.jsonl: loss, accuracy (share of pairs with r_chosen > r_rejected), margin (mean r_chosen − r_rejected),
mean_reward each step, and eval_<name> on evaluated steps. The export (``final``) is the reward-model format of
relayrl/rewards/reward_model.py: ``AutoModelForSequenceClassification.from_pretrained`` loads it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from relayrl.algorithms.reward_loss import bradley_terry_loss
from relayrl.config import ConfigError, RMConfig
from relayrl.data.trl_formats import PREFERENCE, DataFormatError, PreferenceExample, render_preferences
from relayrl.rewards.reward_model import pad_token_of, reward_scores, save_reward_model
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.offline import OfflineStage, load_splits, run_offline

RM_PANELS = (
    ("loss", "loss: Bradley–Terry (training)"),
    ("eval_loss", "eval_loss (held-out)"),
    ("accuracy", "accuracy: r_chosen > r_rejected (training)"),
    ("eval_accuracy", "eval_accuracy: held-out pair accuracy"),
    ("margin", "margin: mean r_chosen − r_rejected (training)"),
    ("eval_margin", "eval_margin (held-out)"),
    ("lr", "learning rate"),
    ("grad_norm", "grad_norm (before clipping)"),
)


def load_data(cfg: RMConfig, tokenizer) -> tuple[list, list | None]:
    """(training pairs, held-out pairs or None): preference rows; a bad dataset or row is a ConfigError of one line
    naming the key, the row and the column."""
    if cfg.model.lora is not None:
        raise ConfigError("model.lora: train rm trains the whole classifier (its new score head with it); unset it")
    if cfg.eval is not None:
        raise ConfigError("eval: the RL loop's eval sets generate with a causal LM; a reward model cannot; unset it")

    def render(rows, fmt) -> list[PreferenceExample]:
        if fmt.kind != PREFERENCE:
            raise DataFormatError(
                f"columns {list(fmt.columns)}: a {fmt.kind} dataset; train rm takes prompt/chosen/rejected or "
                "chosen/rejected rows"
            )
        return render_preferences(rows, tokenizer)

    return load_splits(cfg, render)


class RewardModelClass:
    """``auto_class`` of the backend: the causal checkpoint as a one-label classifier that knows its pad token."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def from_pretrained(self, path: str, **kwargs: Any) -> torch.nn.Module:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, pad_token_id=self.pad_token_id, **kwargs
        )
        model.config.get_text_config().pad_token_id = self.pad_token_id
        return model

    def from_config(self, config: Any, **kwargs: Any) -> torch.nn.Module:
        return AutoModelForSequenceClassification.from_config(config, **kwargs)


class RewardStage(OfflineStage[PreferenceExample]):
    """Bradley–Terry on pairs; sums [loss × pairs, pairs, accuracy × pairs, margin × pairs, score sum]."""

    name = "rm"
    panels = RM_PANELS
    shown = ("loss", "accuracy", "margin")
    sums = 5

    def __init__(self, cfg: RMConfig, tokenizer: Any) -> None:
        self.loss = cfg.loss
        self.tokenizer = tokenizer
        tokenizer.pad_token = pad_token_of(tokenizer)
        self.auto_class = RewardModelClass(tokenizer.pad_token_id)

    def length(self, example: PreferenceExample) -> int:
        return 2 * len(example.prompt_ids) + len(example.chosen_ids) + len(example.rejected_ids)

    def normaliser(self, examples: Sequence[PreferenceExample], indices: Sequence[int]) -> float:
        return len(indices)

    def scores(self, backend: FSDPBackend, sequences: list[list[int]]) -> torch.Tensor:
        """One score per sequence [S] float32: a right-padded batch through the classifier."""
        width = max(len(ids) for ids in sequences)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in sequences], device=backend.device)
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in sequences], device=backend.device)
        with backend.precision.autocast(backend.device):
            return reward_scores(backend.model, input_ids, mask).float()

    def row_forward(self, backend, examples, row, normaliser):
        sequences = []
        for i in row:
            e = examples[i]
            sequences += [e.prompt_ids + e.chosen_ids, e.prompt_ids + e.rejected_ids]
        scores = self.scores(backend, sequences)
        margin = None
        if self.loss.margin and any(examples[i].margin is not None for i in row):
            margin = torch.tensor([examples[i].margin or 0.0 for i in row], device=scores.device)
        loss, metrics = bradley_terry_loss(
            scores[0::2], scores[1::2], margin=margin, center_rewards_coefficient=self.loss.center_rewards_coefficient
        )
        pairs = len(row)
        with torch.no_grad():
            sums = torch.stack(
                [loss * pairs, torch.tensor(float(pairs)), metrics["accuracy"] * pairs, metrics["margin"] * pairs,
                 scores.sum()]
            )  # fmt: skip
        return loss * pairs / normaliser, sums.double().cpu()

    def metrics(self, sums: list[float]) -> dict[str, float]:
        loss, pairs, accuracy, margin, total = sums
        pairs = max(pairs, 1.0)
        return {
            "loss": loss / pairs,
            "accuracy": accuracy / pairs,
            "margin": margin / pairs,
            "mean_reward": total / (2 * pairs),
        }

    def export(self, backend: FSDPBackend, directory, tokenizer) -> None:
        """The reward-model directory (relayrl/rewards/reward_model.py), rank 0 writing (collective)."""
        model = backend.full_model()
        if model is not None:
            save_reward_model(model, self.tokenizer, directory)
        dist.barrier()


def run(cfg: RMConfig, *, resume: bool, data: tuple[list, list | None] | None = None) -> int:
    """Train (every rank calls it; rank 0 writes the run's files); ``data``: ``load_data``'s, where the caller has
    loaded it. Returns the exit code."""
    stage = RewardStage(cfg, AutoTokenizer.from_pretrained(cfg.model.path))
    return run_offline(cfg, stage, load_data, resume=resume, data=data)
