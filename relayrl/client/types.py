"""The client's data types: prompts in, completions out, and their wire form (SubmitPrompts)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from relayrl.v1 import common_pb2, controller_pb2
from relayrl.wire.sampling import SamplingParams

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class Prompt:
    """Text (templated with the model's chat template unless ``raw``) or token ids; ``answer`` feeds the
    reward function. ``prompt_id`` is assigned when empty, so that retries never duplicate a prompt."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    answer: str = ""
    prompt_id: str = ""

    def to_proto(self) -> controller_pb2.SubmitPromptsRequest.Prompt:
        return controller_pb2.SubmitPromptsRequest.Prompt(
            prompt_id=self.prompt_id, text=self.text, token_ids=list(self.token_ids), answer=self.answer
        )


@dataclass(frozen=True)
class Completion:
    """One sampled response. ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under policy
    ``policy_version``; ``reward`` is set when a reward function was named; ``finish_reason`` is
    "stop", "length" or "abort"."""

    prompt_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    worker_id: str
    text: str
    reward: float | None = None

    @classmethod
    def from_proto(cls, message: controller_pb2.SubmittedCompletion) -> Completion:
        c = message.completion
        return cls(
            prompt_id=c.prompt_id,
            sample_index=c.sample_index,
            token_ids=list(c.token_ids),
            logprobs=list(c.logprobs),
            finish_reason=FINISH_REASONS.get(c.finish_reason, "unspecified"),
            policy_version=c.policy_version,
            worker_id=c.worker_id,
            text=c.text,
            reward=message.reward if message.HasField("reward") else None,
        )

    def to_dict(self) -> dict:
        return {
            "prompt_id": self.prompt_id,
            "sample_index": self.sample_index,
            "text": self.text,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "policy_version": self.policy_version,
            "worker_id": self.worker_id,
            "reward": self.reward,
        }


def as_prompts(items: Iterable[str | Prompt | Mapping]) -> list[Prompt]:
    """Strings, Prompts or mappings with the Prompt's keys (``id`` is accepted for ``prompt_id``), each
    with a unique id (assigned ``client-<hex>`` when missing). Raises ValueError on duplicates or junk."""
    prompts, seen = [], set()
    for i, item in enumerate(items):
        if isinstance(item, str):
            prompt = Prompt(text=item)
        elif isinstance(item, Prompt):
            prompt = item
        elif isinstance(item, Mapping):
            unknown = set(item) - {"text", "prompt", "token_ids", "answer", "prompt_id", "id"}
            if unknown:
                raise ValueError(f"prompts[{i}]: unknown keys {sorted(unknown)}")
            prompt = Prompt(
                text=str(item.get("text", item.get("prompt", ""))),
                token_ids=tuple(int(t) for t in item.get("token_ids", ())),
                answer=str(item.get("answer", "")),
                prompt_id=str(item.get("prompt_id", item.get("id", ""))),
            )
        else:
            raise ValueError(f"prompts[{i}]: expected a string, a Prompt or a mapping, got {type(item).__name__}")
        if not prompt.prompt_id:
            prompt = Prompt(prompt.text, prompt.token_ids, prompt.answer, f"client-{uuid.uuid4().hex[:12]}")
        if prompt.prompt_id in seen:
            raise ValueError(f"prompts[{i}]: duplicate prompt id {prompt.prompt_id!r}")
        seen.add(prompt.prompt_id)
        prompts.append(prompt)
    return prompts


def submit_request(
    prompts: Iterable[Prompt], params: SamplingParams, reward_fn: str, raw: bool
) -> controller_pb2.SubmitPromptsRequest:
    return controller_pb2.SubmitPromptsRequest(
        prompts=[p.to_proto() for p in prompts], params=params.to_proto(), reward_fn=reward_fn, raw=raw
    )


class SubmitProgress:
    """Which samples of which prompts arrived: drops duplicates after a retry, says what to resend."""

    def __init__(self, prompts: list[Prompt], n: int) -> None:
        self.n = n
        self.open: dict[str, Prompt] = {p.prompt_id: p for p in prompts}
        self._seen: dict[str, set[int]] = {}

    def accept(self, completion: Completion) -> bool:
        """True when the completion is new (first time this prompt's sample index arrives)."""
        seen = self._seen.setdefault(completion.prompt_id, set())
        if completion.sample_index in seen or completion.prompt_id not in self.open:
            return False
        seen.add(completion.sample_index)
        if len(seen) >= self.n:
            del self.open[completion.prompt_id]
        return True
