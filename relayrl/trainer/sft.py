"""``relayrl train sft``: supervised fine-tuning, one stage of the offline loop (relayrl/trainer/offline.py).

The rows are TRL's formats rendered with their loss masks (relayrl/data/trl_formats.py); each packed row is one
forward of its examples back to back with positions restarting at 0 and no attention mask (``pack_examples``:
transformers then attends within each example only), and its loss is ``sft_loss`` with the step's global
trained-token count, so a step's gradient is the token mean over the whole step however its examples are packed or
shared between ranks.

metrics.jsonl: loss, token_accuracy, lr, grad_norm, tokens, ... each step; eval_loss and eval_token_accuracy on
evaluated steps (step 0: the model before training); with an ``eval`` section, the RL loop's eval lines of the same
steps (relayrl/trainer/offline.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from relayrl.algorithms.sft_loss import SFTBatch, pack_examples, sft_loss, token_accuracy
from relayrl.config import SFTConfig
from relayrl.data.trl_formats import LANGUAGE_MODELING, PROMPT_COMPLETION, DataFormatError, SFTExample, render_sft
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.offline import OfflineStage, load_splits, run_offline

# metrics.png's panels for an SFT run (trainer/metrics.py's plot_training): (metrics.jsonl key, title)
SFT_PANELS = (
    ("loss", "loss: training token mean NLL"),
    ("eval_loss", "eval_loss: held-out token mean NLL"),
    ("token_accuracy", "token_accuracy (training)"),
    ("eval_token_accuracy", "eval_token_accuracy (held-out)"),
    ("lr", "learning rate"),
    ("grad_norm", "grad_norm (before clipping)"),
)


def load_data(cfg: SFTConfig, tokenizer) -> tuple[list[SFTExample], list[SFTExample] | None]:
    """(training examples, held-out examples or None): language-modeling or prompt-completion rows rendered with
    their loss masks; a bad dataset or row is a ConfigError of one line naming the key, the row and the column."""

    def render(rows, fmt) -> list[SFTExample]:
        if fmt.kind not in (LANGUAGE_MODELING, PROMPT_COMPLETION):
            raise DataFormatError(
                f"columns {list(fmt.columns)}: a {fmt.kind} dataset; train sft takes language-modeling (text or "
                "messages) or prompt-completion rows"
            )
        return render_sft(
            rows, tokenizer, completion_only_loss=cfg.data.completion_only_loss,
            assistant_only_loss=cfg.data.assistant_only_loss,
        )  # fmt: skip

    return load_splits(cfg, render)


def trained_tokens(example: SFTExample) -> int:
    """The targets the loss reads in ``example``: its mask past the first token (nothing predicts the first)."""
    return sum(example.loss_mask[1:])


def row_batch(examples: Sequence[SFTExample], indices: Sequence[int]) -> SFTBatch:
    return pack_examples([(examples[i].input_ids, examples[i].loss_mask) for i in indices])


class SFTStage(OfflineStage[SFTExample]):
    """Token-mean NLL over the trained tokens; sums [NLL sum, correct argmax tokens, trained tokens]."""

    name = "sft"
    panels = SFT_PANELS
    shown = ("loss", "token_accuracy")
    sums = 3

    def length(self, example: SFTExample) -> int:
        return len(example.input_ids)

    def normaliser(self, examples: Sequence[SFTExample], indices: Sequence[int]) -> float:
        return sum(trained_tokens(examples[i]) for i in indices)

    def row_forward(
        self, backend: FSDPBackend, examples: Sequence[SFTExample], row: Sequence[int], normaliser: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = row_batch(examples, row)
        device = backend.device
        with backend.precision.autocast(device):
            logits = backend.model(
                input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device), use_cache=False
            ).logits
        logits = logits[:, :-1].float()
        targets, mask = batch.input_ids[:, 1:].to(device), batch.target_mask.to(device)
        # over [positions, vocabulary] rows, the vocabulary contiguous: over logits.transpose(1, 2) the softmax strides
        # by the vocabulary size, and forward and backward ran several times slower
        logprob = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        loss = sft_loss(logprob, mask, num_tokens=normaliser)
        with torch.no_grad():
            trained = mask.sum()
            sums = torch.stack([-(logprob * mask).sum(), token_accuracy(logits, targets, mask) * trained, trained])
        return loss, sums.double().cpu()

    def metrics(self, sums: list[float]) -> dict[str, float]:
        nll, correct, trained = sums
        return {"loss": nll / max(trained, 1), "token_accuracy": correct / max(trained, 1)}


def run(cfg: SFTConfig, *, resume: bool, data: tuple[list[SFTExample], list[SFTExample] | None] | None = None) -> int:
    """Train (every rank calls it; rank 0 writes the run's files); ``data``: ``load_data``'s, where the caller has
    loaded it. Returns the exit code."""
    return run_offline(cfg, SFTStage(), load_data, resume=resume, data=data)
