"""``relayrl train dpo``: DPO, IPO, conservative DPO (relayrl/algorithms/preference_loss.py) and KTO
(relayrl/algorithms/kto_loss.py), stages of the offline loop (relayrl/trainer/offline.py).

Every example forwards a few sequences (prompt + completion, the completion's tokens masked in): a preference pair
its chosen and its rejected one, an unpaired (KTO) example its completion and the mismatched pair of its KL term
(its prompt with the previous example's completion, in data order: ``mismatched_completions`` over the data set).
A packed row holds its examples' sequences back to back, one forward (relayrl/trainer/sequence_logps.py).

The reference policy's log-probs: ``loss.reference: precomputed`` scores every sequence once before training (the
model at model.path, with LoRA the adapter disabled) and caches them in the run directory
(relayrl/trainer/reference_cache.py), so a resumed run reads them back; ``frozen`` scores each row with a frozen
copy (with LoRA: the adapter disabled, no copy).

A step's loss is the mean of its examples' losses (the normaliser: the step's examples). metrics.jsonl carries
TRL's names: loss, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected (KTO: kl, the step's reference point z0, and no accuracies), each also as eval_<name> on evaluated
steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from relayrl.algorithms.kto_loss import kto_loss, kto_reference_point, mismatched_completions
from relayrl.algorithms.preference_loss import compute_preference_loss
from relayrl.config import DPOConfig
from relayrl.data.trl_formats import (
    PREFERENCE,
    UNPAIRED_PREFERENCE,
    DataFormatError,
    PreferenceExample,
    UnpairedExample,
    render_preferences,
    render_unpaired,
)
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.offline import OfflineStage, idle_rows, load_splits, reduced, run_offline
from relayrl.trainer.reference_cache import cache_key, load_cached, model_digest, save_cached
from relayrl.trainer.sequence_logps import completion_sequence, packed_sequence_logps, reference_model
from relayrl.trainer.sft_plan import pack_rows

PAIR_METRICS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
)  # fmt: skip
PREFERENCE_PANELS = (
    ("loss", "loss (training)"),
    ("eval_loss", "eval_loss (held-out)"),
    ("rewards/margins", "rewards/margins: mean β·(ρ_chosen − ρ_rejected)"),
    ("eval_rewards/margins", "eval_rewards/margins (held-out)"),
    ("rewards/accuracies", "rewards/accuracies (training)"),
    ("eval_rewards/accuracies", "eval_rewards/accuracies (held-out)"),
    ("rewards/chosen", "rewards/chosen"),
    ("rewards/rejected", "rewards/rejected"),
    ("kl", "kl: KTO's reference point z0"),
    ("lr", "learning rate"),
    ("grad_norm", "grad_norm (before clipping)"),
)

Sequences = tuple[tuple[list[int], list[int]], ...]


@dataclass(frozen=True)
class Scored:
    """An example, the sequences it forwards, and their reference log-probs (None: a frozen reference scores them
    at each forward)."""

    example: PreferenceExample | UnpairedExample
    sequences: Sequences
    reference: tuple[float, ...] | None = None


def load_data(cfg: DPOConfig, tokenizer) -> tuple[list, list | None]:
    """(training examples, held-out examples or None): preference rows (unpaired ones for loss.type kto); a bad
    dataset or row is a ConfigError of one line naming the key, the row and the column."""
    kto = cfg.loss.type == "kto"

    def render(rows, fmt) -> list:
        wanted = UNPAIRED_PREFERENCE if kto else PREFERENCE
        if fmt.kind != wanted:
            needs = "prompt/completion/label (unpaired)" if kto else "prompt/chosen/rejected or chosen/rejected"
            raise DataFormatError(
                f"columns {list(fmt.columns)}: a {fmt.kind} dataset; loss.type {cfg.loss.type} takes {needs} rows"
            )
        if kto:
            examples = render_unpaired(rows, tokenizer)
            if len(examples) < 2:
                raise DataFormatError("rows: KTO's KL term pairs a prompt with another row's completion; need >= 2")
            return examples
        return render_preferences(rows, tokenizer)

    return load_splits(cfg, render)


class ReferencedStage(OfflineStage[Scored]):
    """What DPO and KTO share: examples as sequences with reference log-probs, and those log-probs computed."""

    name = "dpo"
    panels = PREFERENCE_PANELS

    def __init__(self, cfg: DPOConfig) -> None:
        self.loss = cfg.loss
        self.run_dir, self.model_path, self.pack_tokens = cfg.run_dir, cfg.model.path, cfg.trainer.pack_tokens
        self.with_reference = cfg.loss.reference == "frozen" and cfg.model.lora is None

    def length(self, example: Scored) -> int:
        return sum(len(ids) for ids, _ in example.sequences)

    def normaliser(self, examples: Sequence[Scored], indices: Sequence[int]) -> float:
        return len(indices)

    def prepare(self, backend, examples, heldout):
        """The examples with, ``loss.reference: precomputed``, their reference log-probs: read from the run
        directory's cache, else computed (collective) and cached."""
        if self.loss.reference == "frozen":
            return examples, heldout
        model_hash = model_digest(self.model_path)
        out = []
        for part in (examples, heldout):
            if part is None:
                out.append(None)
                continue
            key = cache_key(model_hash, [example.sequences for example in part])
            logps = load_cached(self.run_dir, key, len(part))
            if logps is None:
                logps = self.reference_logps(backend, part)
                if backend.dp_rank == 0:
                    save_cached(self.run_dir, key, logps)
            out.append([replace(example, reference=tuple(row)) for example, row in zip(part, logps.tolist())])
        return out[0], out[1]

    @torch.no_grad()
    def reference_logps(self, backend: FSDPBackend, examples: Sequence[Scored]) -> torch.Tensor:
        """[N, sequences an example] float64: every sequence's log-prob under the reference (collective)."""
        rows = pack_rows([self.length(example) for example in examples], range(len(examples)), self.pack_tokens)
        mine = rows[backend.dp_rank :: backend.dp_size]
        width = len(examples[0].sequences)
        out = torch.zeros(len(examples), width, dtype=torch.float64)
        backend.model.train(False)
        for row in mine:
            sequences = [sequence for i in row for sequence in examples[i].sequences]
            logps, _ = packed_sequence_logps(backend, sequences, reference=True)
            out[list(row)] = logps.double().cpu().view(len(row), width)
        for _ in range(idle_rows(backend, rows, mine)):
            self.idle_forward(backend)
        backend.model.train(True)
        return reduced(out, backend)

    def references(
        self, backend: FSDPBackend, examples: Sequence[Scored], row: Sequence[int], which: Sequence[int]
    ) -> torch.Tensor:
        """[len(row) × len(which)] float32, example-major: the reference log-probs of sequences ``which`` of each
        example of ``row``, cached or scored now by the frozen reference."""
        if self.loss.reference == "frozen":
            with torch.no_grad():
                sequences = [examples[i].sequences[k] for i in row for k in which]
                return packed_sequence_logps(backend, sequences, reference=True)[0]
        cached = [examples[i].reference[k] for i in row for k in which]
        return torch.tensor(cached, dtype=torch.float32, device=backend.device)

    def idle_forward(self, backend: FSDPBackend) -> torch.Tensor:
        """The policy's idle forward, and the frozen reference's where one scores each row (its collectives too)."""
        if self.loss.reference == "frozen" and backend.dp_size > 1:
            model, context = reference_model(backend)
            one = torch.zeros(1, 1, dtype=torch.long, device=backend.device)
            with torch.no_grad(), context, backend.precision.autocast(backend.device):
                model(input_ids=one, use_cache=False)
        return super().idle_forward(backend)


class PairStage(ReferencedStage):
    """DPO (sigmoid, label-smoothed) and IPO on preference pairs; sums [loss, pairs, each PAIR_METRICS × pairs]."""

    shown = ("loss", "rewards/accuracies", "rewards/margins")
    sums = 2 + len(PAIR_METRICS)

    def arrange(self, examples: Sequence[PreferenceExample]) -> list[Scored]:
        return [
            Scored(
                e, (completion_sequence(e.prompt_ids, e.chosen_ids), completion_sequence(e.prompt_ids, e.rejected_ids))
            )
            for e in examples
        ]

    def row_forward(self, backend, examples, row, normaliser):
        sequences = [sequence for i in row for sequence in examples[i].sequences]
        logps, tokens = packed_sequence_logps(backend, sequences)
        reference = self.references(backend, examples, row, (0, 1))
        loss, metrics = compute_preference_loss(
            self.loss.type, logps[0::2], logps[1::2], reference[0::2], reference[1::2], beta=self.loss.beta,
            label_smoothing=self.loss.label_smoothing, chosen_tokens=tokens[0::2], rejected_tokens=tokens[1::2],
        )  # fmt: skip
        pairs = len(row)
        sums = [loss.detach().sum(), torch.tensor(float(pairs)), *(metrics[key] * pairs for key in PAIR_METRICS)]
        return loss.sum() / normaliser, torch.stack([s.detach().double().cpu() for s in sums])

    def metrics(self, sums: list[float]) -> dict[str, float]:
        loss, pairs, *rest = sums
        pairs = max(pairs, 1.0)
        return {"loss": loss / pairs, **{key: value / pairs for key, value in zip(PAIR_METRICS, rest)}}


class UnpairedStage(ReferencedStage):
    """KTO on unpaired examples. A step first scores its examples' mismatched pairs without gradient (every rank's
    rows) for z0 = max(0, mean (policy − reference) log-prob), then trains on the examples' own sequences.
    Sums [loss, examples, desirable, their rewards and logps, undesirable, their rewards and logps]."""

    shown = ("loss", "rewards/chosen", "rewards/rejected", "kl")
    sums = 8
    z0 = 0.0  # the reference point of the step (or held-out set) begin_step scored last

    def arrange(self, examples: Sequence[UnpairedExample]) -> list[Scored]:
        mismatched = mismatched_completions([e.completion_ids for e in examples])
        return [
            Scored(e, (completion_sequence(e.prompt_ids, e.completion_ids), completion_sequence(e.prompt_ids, kl)))
            for e, kl in zip(examples, mismatched)
        ]

    @torch.no_grad()
    def begin_step(self, backend: FSDPBackend, examples: Sequence[Scored], rows: list[list[int]]) -> None:
        """z0 of the step's (or held-out set's) ``rows`` (collective)."""
        mine = rows[backend.dp_rank :: backend.dp_size]
        policy, reference = [], []
        for row in mine:
            policy.append(packed_sequence_logps(backend, [examples[i].sequences[1] for i in row])[0])
            reference.append(self.references(backend, examples, row, (1,)))
        for _ in range(idle_rows(backend, rows, mine)):
            self.idle_forward(backend)
        gaps = torch.cat(policy) - torch.cat(reference) if policy else torch.zeros(0)
        total = reduced(torch.tensor([gaps.double().sum().item(), float(gaps.numel())], dtype=torch.float64), backend)
        count = max(total[1].item(), 1.0)
        self.z0 = float(kto_reference_point(torch.tensor([total[0].item() / count]), torch.zeros(1)))

    def row_forward(self, backend, examples, row, normaliser):
        own = [examples[i].sequences[0] for i in row]
        logps, _ = packed_sequence_logps(backend, own)
        reference = self.references(backend, examples, row, (0,))
        desirable = torch.tensor([examples[i].example.label for i in row], device=logps.device)
        loss, _ = kto_loss(
            logps, reference, desirable, beta=self.loss.beta, kl=self.z0,
            desirable_weight=self.loss.desirable_weight, undesirable_weight=self.loss.undesirable_weight,
        )  # fmt: skip
        with torch.no_grad():
            rewards = self.loss.beta * (logps - reference)
            sums = [loss.sum(), torch.tensor(float(len(row)))]
            for side in (desirable, ~desirable):
                sums += [side.sum().float(), rewards[side].sum(), logps[side].sum()]
        return loss.sum() / normaliser, torch.stack([s.double().cpu() for s in sums])

    def metrics(self, sums: list[float]) -> dict[str, float]:
        loss, count, n_chosen, chosen_rewards, chosen_logps, n_rejected, rejected_rewards, rejected_logps = sums
        out = {"loss": loss / max(count, 1.0), "kl": self.z0}
        for side, n, rewards, logps in (
            ("chosen", n_chosen, chosen_rewards, chosen_logps),
            ("rejected", n_rejected, rejected_rewards, rejected_logps),
        ):
            if n:
                out[f"rewards/{side}"], out[f"logps/{side}"] = rewards / n, logps / n
        if n_chosen and n_rejected:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def stage_of(cfg: DPOConfig) -> ReferencedStage:
    return UnpairedStage(cfg) if cfg.loss.type == "kto" else PairStage(cfg)


def run(cfg: DPOConfig, *, resume: bool, data: tuple[list, list | None] | None = None) -> int:
    """Train (every rank calls it; rank 0 writes the run's files); ``data``: ``load_data``'s, where the caller has
    loaded it. Returns the exit code."""
    return run_offline(cfg, stage_of(cfg), load_data, resume=resume, data=data)
