"""Sampling parameters, server-side limits, and request validation for Generate.

The server validates every request before it reaches an engine, so engines can trust their input.
A client in another language leaves proto3 fields unset and they arrive as zeros: ``from_proto`` gives each
omitted field the default common.proto documents (the dataclass defaults below). ``n``, ``top_p`` and
``max_tokens`` at 0 mean omitted (0 is never valid for them); ``temperature`` is ``optional`` on the wire,
because ``temperature=0`` is meaningful: greedy decoding. A temperature in (0, MIN_TEMPERATURE) is refused:
logits / temperature overflows there (vLLM clamps such values to the same bound; relayrl refuses
them, because a clamped temperature would no longer be the one the trainer scores logprobs at).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from relayrl.errors import InvalidArgument, ResourceExhausted
from relayrl.v1 import common_pb2

MIN_TEMPERATURE = 1e-2
# stop strings a request may carry, and their length: each is searched for in every row's text at every step
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def temperature_ok(temperature: float) -> bool:
    """0 (greedy) or a finite value >= MIN_TEMPERATURE."""
    return temperature == 0 or (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``n`` responses per prompt, each at most ``max_tokens`` long.

    ``temperature`` 0 means greedy; logprobs are those of softmax(logits / temperature) before top-p
    (at temperature 1 when greedy). ``stop_token_ids`` end a response in addition to the EOS tokens and are
    included in it. ``seed`` makes a request reproducible; None draws from the engine's own generator.
    vLLM's two equal-work knobs: ``min_tokens`` masks EOS and the stop tokens until that many tokens are out
    (the logprob reported stays that of the unmasked softmax, vLLM's default raw log-probs), and ``ignore_eos``
    lets EOS be sampled without ending the response (stop tokens still end it).
    ``stop`` strings end a response once its decoded text (past ``min_tokens``) contains one, as vLLM's ``stop``
    does: the token ids keep every sampled token (the one that completed the string included: what the policy
    sampled is what is trained) and the response's text ends before the string (``stop_text``), or after it with
    ``include_stop_str_in_output``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplingParams) -> SamplingParams:
        """The wire message with common.proto's defaults for omitted fields: ``n``, ``top_p`` and ``max_tokens``
        at 0, and ``temperature`` and ``seed`` not set (a negative or NaN value is kept: validation names it)."""
        return cls(
            n=msg.n or cls.n,
            temperature=msg.temperature if msg.HasField("temperature") else cls.temperature,
            top_p=msg.top_p or cls.top_p,
            max_tokens=msg.max_tokens or cls.max_tokens,
            stop_token_ids=tuple(msg.stop_token_ids),
            seed=msg.seed if msg.HasField("seed") else None,
            min_tokens=msg.min_tokens,
            ignore_eos=msg.ignore_eos,
            stop=tuple(msg.stop),
            include_stop_str_in_output=msg.include_stop_str_in_output,
        )

    def to_proto(self) -> common_pb2.SamplingParams:
        """The wire message; ``seed`` is left unset when None."""
        return common_pb2.SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
            stop_token_ids=list(self.stop_token_ids),
            seed=self.seed,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=list(self.stop),
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


def first_stop(text: str, stop: Sequence[str]) -> tuple[int, int] | None:
    """(start, end) of the stop string occurrence in ``text`` that is completed first (the smallest end; on a tie
    the earlier string of ``stop``): where an engine checking after every token stopped. None: no stop string."""
    found = [(i + len(s), i) for s in stop if (i := text.find(s)) >= 0]
    if not found:
        return None
    end, start = min(found, key=lambda pair: pair[0])
    return start, end


def stop_text(text: str, stop: Sequence[str], include: bool = False) -> str:
    """A response's text as vLLM returns it: cut before the first completed stop string (after it with
    ``include``, vLLM's ``include_stop_str_in_output``); ``text`` when it holds none."""
    found = first_stop(text, stop)
    if found is None:
        return text
    return text[: found[1] if include else found[0]]


@dataclass(frozen=True)
class GenerationLimits:
    """Per-request limits a server enforces with RESOURCE_EXHAUSTED."""

    max_prompts: int = 1024
    max_n: int = 64
    max_tokens: int = 4096
    max_message_bytes: int = 64 << 20  # a response message (routing replay's routed experts count against it)


def validate_request(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    limits: GenerationLimits,
) -> None:
    """Raise ``InvalidArgument`` (field path + reason) or ``ResourceExhausted`` for the first problem found.

    Fields: ``prompts``, ``prompts[i].token_ids``, ``params.n``, ``params.temperature``, ``params.top_p``,
    ``params.max_tokens``, ``params.min_tokens``, ``params.stop_token_ids``. Returns None when the request is valid.
    """
    _validate_params(params, vocab_size=vocab_size, limits=limits)
    if not prompts:
        raise InvalidArgument("prompts", "at least one prompt is required")
    if len(prompts) > limits.max_prompts:
        raise ResourceExhausted("prompts", limits.max_prompts, len(prompts))
    for i, token_ids in enumerate(prompts):
        _validate_prompt(i, token_ids, params.max_tokens, vocab_size=vocab_size, max_model_len=max_model_len)


def _validate_params(params: SamplingParams, *, vocab_size: int, limits: GenerationLimits) -> None:
    if params.n <= 0:
        raise InvalidArgument("params.n", f"must be >= 1, got {params.n}")
    if params.n > limits.max_n:
        raise ResourceExhausted("params.n", limits.max_n, params.n)
    if not temperature_ok(params.temperature):
        raise InvalidArgument(
            "params.temperature", f"must be 0 (greedy) or a finite value >= {MIN_TEMPERATURE}, got {params.temperature}"
        )
    if not 0 < params.top_p <= 1:  # also refuses NaN
        raise InvalidArgument("params.top_p", f"must be in (0, 1] (1 disables top-p), got {params.top_p}")
    if params.max_tokens <= 0:
        raise InvalidArgument("params.max_tokens", f"must be >= 1, got {params.max_tokens}")
    if params.max_tokens > limits.max_tokens:
        raise ResourceExhausted("params.max_tokens", limits.max_tokens, params.max_tokens)
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise InvalidArgument(
            "params.min_tokens", f"must be in [0, max_tokens={params.max_tokens}], got {params.min_tokens}"
        )
    bad = _first_outside_vocab(params.stop_token_ids, vocab_size)
    if bad is not None:
        raise InvalidArgument("params.stop_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise ResourceExhausted("params.stop", MAX_STOP_STRINGS, len(params.stop))
    for i, string in enumerate(params.stop):
        if not string or len(string) > MAX_STOP_CHARS:
            raise InvalidArgument(f"params.stop[{i}]", f"must be 1 to {MAX_STOP_CHARS} characters, got {len(string)}")


def _validate_prompt(
    index: int, token_ids: Sequence[int], max_tokens: int, *, vocab_size: int, max_model_len: int
) -> None:
    field = f"prompts[{index}].token_ids"
    if len(token_ids) == 0:
        raise InvalidArgument(field, "a prompt needs at least one token")
    bad = _first_outside_vocab(token_ids, vocab_size)
    if bad is not None:
        raise InvalidArgument(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) + max_tokens > max_model_len:
        raise InvalidArgument(
            "params.max_tokens",
            f"prompts[{index}] has {len(token_ids)} tokens; {len(token_ids)} + max_tokens {max_tokens} "
            f"= {len(token_ids) + max_tokens} exceeds the model's context max_model_len {max_model_len}",
        )


def _first_outside_vocab(token_ids: Sequence[int], vocab_size: int) -> int | None:
    """The first id not in [0, vocab_size), or None."""
    return next((t for t in token_ids if not 0 <= t < vocab_size), None)
