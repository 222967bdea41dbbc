"""SamplingParams <-> proto, and request validation: exact field paths and the right error kind."""

from __future__ import annotations

import math

import pytest

from relayrl.errors import InvalidArgument, ResourceExhausted
from relayrl.v1 import common_pb2
from relayrl.wire.sampling import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    GenerationLimits,
    SamplingParams,
    first_stop,
    stop_text,
    validate_request,
)

VOCAB, CONTEXT = 100, 64
LIMITS = GenerationLimits(max_prompts=4, max_n=8, max_tokens=32)
PROMPTS = [[1, 2, 3], [4, 5]]


def validate(prompts=PROMPTS, **params) -> None:
    validate_request(prompts, SamplingParams(**params), vocab_size=VOCAB, max_model_len=CONTEXT, limits=LIMITS)


def test_proto_round_trip_keeps_every_field() -> None:
    params = SamplingParams(
        n=4, temperature=0.5, top_p=0.25, max_tokens=7, stop_token_ids=(3, 9), seed=0, stop=("</a>", "\n\n"),
        include_stop_str_in_output=True,
    )  # fmt: skip
    assert SamplingParams.from_proto(params.to_proto()) == params
    unseeded = SamplingParams(seed=None)
    assert not unseeded.to_proto().HasField("seed")
    assert SamplingParams.from_proto(unseeded.to_proto()).seed is None


def test_omitted_fields_get_the_documented_defaults() -> None:
    """common.proto: n 1, temperature 1.0, top_p 1.0, max_tokens 16, no seed (issue #27 item 8: a Node client
    that omits params.top_p was refused)."""
    params = SamplingParams.from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=16, seed=None)
    validate_request(PROMPTS, params, vocab_size=VOCAB, max_model_len=CONTEXT, limits=LIMITS)
    greedy = SamplingParams.from_proto(common_pb2.SamplingParams(temperature=0.0, max_tokens=4))
    assert (greedy.temperature, greedy.top_p, greedy.max_tokens) == (0.0, 1.0, 4)  # an explicit 0 is kept
    negative = SamplingParams.from_proto(common_pb2.SamplingParams(n=-2))
    with pytest.raises(InvalidArgument) as err:  # only 0 means omitted: a wrong value is still refused
        validate_request(PROMPTS, negative, vocab_size=VOCAB, max_model_len=CONTEXT, limits=LIMITS)
    assert err.value.field == "params.n"


def test_valid_request_passes() -> None:
    validate(n=8, temperature=0.0, top_p=1.0, max_tokens=32, stop_token_ids=(0, VOCAB - 1))
    validate(prompts=[[0] * (CONTEXT - 32)] * 4, max_tokens=32)


@pytest.mark.parametrize(
    ("prompts", "params", "field", "words"),
    [
        ([], {}, "prompts", []),
        ([[1], [2], [], [3]], {}, "prompts[2].token_ids", []),
        ([[1], [2, VOCAB + 5]], {}, "prompts[1].token_ids", [str(VOCAB + 5), str(VOCAB)]),
        ([[1], [-1]], {}, "prompts[1].token_ids", ["-1"]),
        (PROMPTS, {"n": 0}, "params.n", []),
        (PROMPTS, {"n": -2}, "params.n", []),
        (PROMPTS, {"temperature": -0.1}, "params.temperature", []),
        (PROMPTS, {"temperature": math.nan}, "params.temperature", []),
        (PROMPTS, {"temperature": math.inf}, "params.temperature", []),
        (PROMPTS, {"temperature": 1.401298464324817e-45}, "params.temperature", []),  # found by the fuzzer
        (PROMPTS, {"temperature": 0.009}, "params.temperature", []),
        (PROMPTS, {"top_p": 0.0}, "params.top_p", []),
        (PROMPTS, {"top_p": 1.5}, "params.top_p", []),
        (PROMPTS, {"top_p": math.nan}, "params.top_p", []),
        (PROMPTS, {"max_tokens": 0}, "params.max_tokens", []),
        ([[1] * 40], {"max_tokens": 30}, "params.max_tokens", ["40", "30", str(CONTEXT)]),
        (PROMPTS, {"stop_token_ids": (5, VOCAB + 3)}, "params.stop_token_ids", [str(VOCAB + 3)]),
        (PROMPTS, {"stop_token_ids": (-1,)}, "params.stop_token_ids", ["-1"]),
        (PROMPTS, {"stop": ("a", "")}, "params.stop[1]", ["0"]),
        (PROMPTS, {"stop": ("x" * (MAX_STOP_CHARS + 1),)}, "params.stop[0]", [str(MAX_STOP_CHARS + 1)]),
    ],
)
def test_invalid_argument_names_the_field(prompts, params, field, words) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate(prompts=prompts, **params)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")
    for word in words:
        assert word in err.value.reason


@pytest.mark.parametrize(
    ("prompts", "params", "field"),
    [
        ([[1]] * 5, {}, "prompts"),
        (PROMPTS, {"n": 9}, "params.n"),
        (PROMPTS, {"max_tokens": 33}, "params.max_tokens"),
        (PROMPTS, {"stop": ("a",) * (MAX_STOP_STRINGS + 1)}, "params.stop"),
    ],
)
def test_limits_raise_resource_exhausted(prompts, params, field) -> None:
    with pytest.raises(ResourceExhausted) as err:
        validate(prompts=prompts, **params)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("text", "stop", "include", "expected"),
    [
        ("x = 1</a> and </a>", ("</a>",), False, "x = 1"),  # vLLM's default: the string is not in the text
        ("x = 1</a> and </a>", ("</a>",), True, "x = 1</a>"),  # include_stop_str_in_output
        ("ab\n\ncd</a>", ("</a>", "\n\n"), False, "ab"),  # the string completed first wins, not the first listed
        ("abcd", ("bcd", "bc"), False, "a"),  # "bc" completes at the 3rd character, before "bcd"
        ("no stop here", ("</a>",), False, "no stop here"),
    ],
)
def test_stop_text_cuts_as_vllm_does(text, stop, include, expected) -> None:
    assert stop_text(text, stop, include) == expected
    assert (first_stop(text, stop) is None) == (expected == text)
