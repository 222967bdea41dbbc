"""The models a scorer serves, one class per ``scorers.<name>.kind``, each a batch function for the batcher.

- ``Classifier``: an HF ``AutoModelForSequenceClassification`` with one label (relayrl/rewards/reward_model.py).
  Each conversation is re-rendered with the scorer's own tokenizer: its chat template when it has one, else the
  messages' contents joined by newlines (a plain-text reward model, as TRL's non-conversational rows). The policy's
  token ids are not read: the two vocabularies may differ. The score is the head's output at the last token.
- ``Judge``: a chat model asked ``rubric`` (``{prompt}``: the conversation's first user message, ``{response}``:
  its last assistant message), greedy, ``judge_max_tokens`` tokens; the score is the first number of its answer.
  An answer without a number fails its request with the answer in the message.
- ``Teacher``: a causal LM; for each item, log p(response_t | prompt, response_<t) of every response token, read
  from the given token ids (a teacher shares the policy's vocabulary).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.algorithms.logprobs import logprobs_from_logits
from relayrl.config import ScorerConfig
from relayrl.errors import InvalidArgument, ResourceExhausted
from relayrl.rewards.reward_model import load_reward_model, pad_token_of, reward_scores
from relayrl.runtime.precision import compute_dtype

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Prepared:
    """A checked item: the token ids the model reads and how many of the last are the response's."""

    tokens: list[int]
    response_len: int


@dataclass(frozen=True)
class Pair:
    """One (prompt, response) pair of a request: chat messages (role/content dicts) and the policy's token ids."""

    messages: list[dict[str, str]] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)


def first_content(messages: Sequence[dict[str, str]], role: str, *, last: bool = False) -> str:
    """The content of the first (``last``: the last) message of ``role``, '' when there is none."""
    found = [m["content"] for m in messages if m["role"] == role]
    return (found[-1] if last else found[0]) if found else ""


def right_padded(rows: list[list[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], attention mask [B, L]) of ``rows`` padded on the right with ``pad_id``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids.to(device), mask.to(device)


class ScoringModel:
    """What every kind has: a tokenizer, a device, the checks of a request's items and a batch function."""

    kind = ""

    def __init__(self, cfg: ScorerConfig) -> None:
        self.cfg = cfg
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype, _ = compute_dtype(cfg.precision, self.device)
        self.tokenizer: Any = None
        self.vocab_size = 0

    def tokens(self, pair: Pair) -> list[int]:
        """The token ids the model reads for ``pair``."""
        raise NotImplementedError

    def check(self, index: int, pair: Pair) -> Prepared:
        """``pair`` as the model reads it, or InvalidArgument / ResourceExhausted naming ``items[index]``'s field."""
        for j, ids in (("prompt_token_ids", pair.prompt_ids), ("response_token_ids", pair.response_ids)):
            if bad := next((t for t in ids if not 0 <= t < self.vocab_size), None):
                raise InvalidArgument(
                    f"items[{index}].{j}", f"{bad} is not a token id of the scorer (0..{self.vocab_size - 1})"
                )
        tokens = self.tokens(pair)
        if len(tokens) > self.cfg.max_tokens:
            raise ResourceExhausted(f"items[{index}] tokens", self.cfg.max_tokens, len(tokens))
        return Prepared(tokens, len(pair.response_ids))

    def run(self, batch: list[Prepared]) -> list:
        """One model call on the checked tokens of several items: a result (or an Exception) each."""
        raise NotImplementedError


class Classifier(ScoringModel):
    kind = "classifier"

    def __init__(self, cfg: ScorerConfig) -> None:
        super().__init__(cfg)
        self.model, self.tokenizer = load_reward_model(cfg.model, dtype=self.dtype)
        self.model.to(self.device)
        self.pad_id = self.model.config.get_text_config().pad_token_id
        self.vocab_size = len(self.tokenizer)

    def render(self, messages: list[dict[str, str]]) -> str:
        """The conversation as this scorer's tokenizer writes it (module docstring)."""
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n".join(m["content"] for m in messages)

    def tokens(self, pair: Pair) -> list[int]:
        return self.tokenizer(self.render(pair.messages), add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def run(self, batch: list[Prepared]) -> list[float]:
        ids, mask = right_padded([p.tokens for p in batch], self.pad_id, self.device)
        return reward_scores(self.model, ids, mask).float().tolist()


class CausalModel(ScoringModel):
    """A causal LM and its tokenizer (judge, teacher), its pad token set (its own, else EOS)."""

    def __init__(self, cfg: ScorerConfig) -> None:
        super().__init__(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.tokenizer.pad_token = pad_token_of(self.tokenizer)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=self.dtype).to(self.device).eval()
        self.vocab_size = self.model.config.get_text_config().vocab_size


class Judge(CausalModel):
    kind = "judge"

    def tokens(self, pair: Pair) -> list[int]:
        question = self.cfg.rubric.format(
            prompt=first_content(pair.messages, "user"), response=first_content(pair.messages, "assistant", last=True)
        )
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True, return_dict=False
        )

    @torch.no_grad()
    def run(self, batch: list[Prepared]) -> list[float | Exception]:
        rows = [p.tokens for p in batch]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=self.cfg.judge_max_tokens, do_sample=False,
            pad_token_id=pad,
        )  # fmt: skip
        answers = self.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        return [judged_score(answer) for answer in answers]


def judged_score(answer: str) -> float | Exception:
    """The first number in a judge's answer, else a ValueError quoting it."""
    match = _NUMBER.search(answer)
    return float(match.group()) if match else ValueError(f"the judge answered {answer.strip()[:80]!r}: no number")


class Teacher(CausalModel):
    kind = "teacher"

    def check(self, index: int, pair: Pair) -> Prepared:
        if not pair.prompt_ids or not pair.response_ids:
            field_name = "prompt_token_ids" if not pair.prompt_ids else "response_token_ids"
            raise InvalidArgument(f"items[{index}].{field_name}", "a teacher needs the prompt's and the response's ids")
        return super().check(index, pair)

    def tokens(self, pair: Pair) -> list[int]:
        return [*pair.prompt_ids, *pair.response_ids]

    @torch.no_grad()
    def run(self, batch: list[Prepared]) -> list[list[float]]:
        """Position p's logits give token p+1's log-prob: a response of n tokens ending at L reads [L-n-1, L-1)."""
        ids, mask = right_padded([p.tokens for p in batch], self.tokenizer.pad_token_id, self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        logprobs = logprobs_from_logits(logits, ids[:, 1:])
        ends = [len(p.tokens) - 1 for p in batch]
        return [logprobs[i, end - p.response_len : end].tolist() for i, (p, end) in enumerate(zip(batch, ends))]


KINDS: dict[str, type[ScoringModel]] = {"classifier": Classifier, "judge": Judge, "teacher": Teacher}


def load_scoring_model(cfg: ScorerConfig) -> ScoringModel:
    """The model of ``cfg.kind``, loaded on this machine's device in the precision ``cfg.precision`` resolves to."""
    return KINDS[cfg.kind](cfg)
