"""Reward functions beyond ``fn(response, answer)``: the form read from the signature (per response, batched,
positional), async ones, the dataset row and the conversation as inputs, the environment's episode reward, and
the error for each wrong return shape, which names the function and the shape."""

from __future__ import annotations

import asyncio
import math
import uuid

import numpy as np
import pytest

from relayrl.config import RewardConfig
from relayrl.controller.scoring import EpisodeOutcome, Scorer, group_inputs
from relayrl.data.dataset import PromptRecord
from relayrl.rewards import (
    GroupInputs,
    RewardCaller,
    RewardRaised,
    RewardShapeError,
    check_reward,
    reward_signature,
)
from relayrl.v1 import common_pb2


def caller(fn, name: str = "mod:fn", form: str = "auto") -> RewardCaller:
    return RewardCaller(fn, name, reward_signature(fn, name, form))


def inputs(responses=("4", "5", "x"), answer="4", row=None, env_rewards=None) -> GroupInputs:
    row = {"prompt": "2 + 2 =", "answer": answer, "difficulty": 3} if row is None else row
    return GroupInputs(
        list(responses),
        answer,
        "2 + 2 =",
        row,
        [[{"role": "user", "content": "2 + 2 ="}, {"role": "assistant", "content": r}] for r in responses],
        env_rewards if env_rewards is not None else [None] * len(responses),
    )


# -- the form, from the signature ---------------------------------------------------------------------------------
def test_the_original_two_argument_form_is_called_positionally_whatever_its_names() -> None:
    def legacy(text, ref):
        return float(text == ref)

    sig = reward_signature(legacy, "legacy")
    assert not sig.batched and sig.keywords is None
    assert caller(legacy)(inputs()) == [1.0, 0.0, 0.0]


def test_a_per_response_function_gets_the_arguments_it_names() -> None:
    seen = []

    def judge(response, row, conversation, scale=2.0):  # a parameter with a default keeps it
        seen.append((row["difficulty"], conversation[-1]["content"]))
        return scale * float(response == row["answer"])

    sig = reward_signature(judge, "judge")
    assert not sig.batched and sig.keywords == ("response", "row", "conversation")
    assert caller(judge)(inputs()) == [2.0, 0.0, 0.0]
    assert seen == [(3, "4"), (3, "5"), (3, "x")]


def test_a_batched_function_is_called_once_per_group_with_lists() -> None:
    calls = []

    def batch(responses, rows, conversations, env_rewards):
        calls.append((len(responses), len(rows), len(conversations), env_rewards))
        return [float(r == row["answer"]) for r, row in zip(responses, rows)]

    sig = reward_signature(batch, "batch")
    assert sig.batched and sig.keywords == ("responses", "rows", "conversations", "env_rewards")
    assert caller(batch)(inputs()) == [1.0, 0.0, 0.0]
    assert calls == [(3, 3, 3, [None, None, None])]


def test_async_functions_are_awaited_and_per_response_calls_run_concurrently() -> None:
    running, most = 0, 0

    async def judge(response, answer):
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0)  # a judge's request in flight: the other calls start meanwhile
        running -= 1
        return float(response == answer)

    async def batched(responses):
        await asyncio.sleep(0)
        return np.array([0.5] * len(responses))  # numpy counts as a list of floats

    assert caller(judge)(inputs()) == [1.0, 0.0, 0.0]
    assert most == 3  # all three were in flight at once: gathered, not awaited one by one
    assert caller(batched)(inputs()) == [0.5, 0.5, 0.5]


@pytest.mark.parametrize(
    ("fn", "form", "message"),
    [
        (lambda response, answers: 0.0, "auto", r"mixes per-response \(response\) and batched \(answers\)"),
        (lambda responses, gold: [0.0], "auto", r"the batch form passes responses, .*; none for gold"),
        (lambda **kwargs: 0.0, "auto", r"set controller.reward.form"),
        (lambda a, b, c: 0.0, "auto", r"name its parameters from response, answer, prompt, row, conversation"),
        (lambda text, ref: 0.0, "batch", r"none for ref, text"),
    ],
)
def test_a_signature_that_fits_no_form_is_refused_naming_the_function(fn, form, message) -> None:
    with pytest.raises(ValueError, match=r"reward function mod:fn\(.*\)") as err:
        reward_signature(fn, "mod:fn", form)
    assert err.match(message)


def test_a_kwargs_function_with_a_form_gets_every_argument_of_it() -> None:
    got = {}

    def anything(**kwargs):
        got.update(kwargs)
        return [1.0] * len(kwargs["responses"])

    assert caller(anything, form="batch")(inputs()) == [1.0, 1.0, 1.0]
    assert set(got) == {"responses", "answers", "prompts", "rows", "conversations", "env_rewards"}


def test_check_reward_names_the_config_field(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def three(a, b, c):\n    return 0.0\n\nasync def ok(responses):\n    return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check_reward(RewardConfig(fn="my_rewards:ok")).signature.batched
    assert check_reward(RewardConfig(fn="exact_match")).signature.keywords == ("response", "answer")
    with pytest.raises(ValueError, match=r"^controller.reward.fn: reward function my_rewards:three\(a, b, c\)"):
        check_reward(RewardConfig(fn="my_rewards:three"))
    with pytest.raises(ValueError, match=r"^controller.reward.fn: unknown reward function 'nope'"):
        check_reward(RewardConfig(fn="nope"))
    with pytest.raises(ValueError, match=r"^controller.reward.fn: reward function 'no_such_mod:f' cannot be imported"):
        check_reward(RewardConfig(fn="no_such_mod:f"))


# -- wrong return shapes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("returned", "shape"),
    [
        (1.0, "returned float for a group of 3 responses"),
        ([1.0, 0.0], "returned list of 2 for a group of 3 responses"),
        (np.zeros((3, 1)), r"returned ndarray of shape \(3, 1\) for a group of 3"),
        ({"a": 1.0}, "returned dict for a group of 3"),
        ([1.0, math.nan, 0.0], r"returned nan \(float\) for response 1 of 3"),
        ([1.0, None, 0.0], r"returned None \(NoneType\) for response 1 of 3"),
        (["1", "0", "0"], r"returned '1' \(str\) for response 0 of 3"),
    ],
)
def test_a_batched_function_of_the_wrong_shape_is_an_error_naming_it_and_the_shape(returned, shape) -> None:
    def broken(responses):
        return returned

    with pytest.raises(RewardShapeError, match=rf"^reward function 'mod:fn' \(batched\) {shape}"):
        caller(broken)(inputs())


@pytest.mark.parametrize(
    ("returned", "shape"),
    [(math.inf, r"inf \(float\)"), ([1.0], r"\[1.0\] \(list of 1\)"), ("1.0", r"'1.0' \(str\)")],
)
def test_a_per_response_function_of_the_wrong_type_is_an_error_naming_it(returned, shape) -> None:
    async def broken(response):
        return returned

    with pytest.raises(RewardShapeError, match=rf"^reward function 'mod:fn' \(per-response\) returned {shape}"):
        caller(broken)(inputs())


def test_a_function_that_raises_is_reported_with_its_name_and_error() -> None:
    def judge(response, answer):
        raise ConnectionError("judge unreachable")

    with pytest.raises(RewardRaised, match=r"^reward function 'mod:fn' raised ConnectionError: judge unreachable"):
        caller(judge)(inputs())


# -- the scorer: rows, conversations, episodes ----------------------------------------------------------------------
class Tokens:
    """decode_sequences' tokenizer: ids are characters."""

    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(i) for i in ids) for ids in seqs]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def completions(texts: list[str]) -> list[common_pb2.Completion]:
    return [common_pb2.Completion(sample_index=i, token_ids=[ord(c) for c in t]) for i, t in enumerate(texts)]


def scorer(tmp_path, monkeypatch, source: str, **cfg) -> tuple[Scorer, list[str]]:
    """A Scorer of ``source``'s ``fn``, written as a module of its own (an import is cached by name)."""
    module = f"task_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows_read: list[str] = []

    def row_of(prompt_id: str) -> dict:
        rows_read.append(prompt_id)
        return {"prompt": "2 + 2 =", "answer": "4", "unit": "apples"}

    return Scorer(RewardConfig(fn=f"{module}:fn", **cfg), Tokens(), 8, row_of), rows_read


RECORD = PromptRecord("0:7", "2 + 2 =", [1, 2], "4")


def test_the_scorer_reads_the_row_only_for_a_function_that_asks_for_it(tmp_path, monkeypatch) -> None:
    source = (
        "def fn(responses, rows):\n    return [float(r == f\"4 {row['unit']}\") for r, row in zip(responses, rows)]\n"
    )
    s, rows_read = scorer(tmp_path, monkeypatch, source)
    assert s.group(RECORD, completions(["4 apples", "4"])).scores == [1.0, 0.0]
    assert rows_read == ["0:7"]  # once per group
    s, rows_read = scorer(tmp_path, monkeypatch, "def fn(response, answer):\n    return float(response == answer)\n")
    assert s.group(RECORD, completions(["4", "5"])).scores == [1.0, 0.0] and rows_read == []


def test_a_single_turn_conversation_is_the_prompt_and_the_response() -> None:
    got = group_inputs("2 + 2 =", "4", {}, ["4", "5"], None)
    assert got.conversations[1] == [{"role": "user", "content": "2 + 2 ="}, {"role": "assistant", "content": "5"}]
    assert got.env_rewards == [None, None]


def test_the_scorer_sorts_a_group_by_sample_index(tmp_path, monkeypatch) -> None:
    s, _ = scorer(tmp_path, monkeypatch, "def fn(responses):\n    return [float(len(r)) for r in responses]\n")
    group = s.group(RECORD, list(reversed(completions(["a", "bb", "ccc"]))))
    assert [c.sample_index for c in group.completions] == [0, 1, 2] and group.scores == [1.0, 2.0, 3.0]


def test_the_reward_reads_the_text_cut_at_its_stop_string(tmp_path, monkeypatch) -> None:
    """rollout.stop: the response's ids keep the stop string (it was sampled), the reward's text ends before it
    (vLLM's text), or after it with rollout.include_stop_str_in_output."""
    s, _ = scorer(tmp_path, monkeypatch, "def fn(responses):\n    return [float(len(r)) for r in responses]\n")
    texts = ["4</a>x", "44", "4\n\n</a>"]
    for include, lengths in ((False, [1.0, 2.0, 1.0]), (True, [5.0, 2.0, 3.0])):
        s.stop, s.include_stop = ("</a>", "\n\n"), include
        assert s.group(RECORD, completions(texts)).scores == lengths


EPISODES = [
    EpisodeOutcome([{"role": "user", "content": "guess"}, {"role": "assistant", "content": "<answer>4</answer>"}], 1.0),
    EpisodeOutcome([{"role": "user", "content": "guess"}, {"role": "assistant", "content": "7"}], 0.0),
]
BONUS = "def fn(response, env_reward):\n    return 0.1 * response.startswith('<answer>')\n"


@pytest.mark.parametrize(("with_env", "scores"), [("env", [1.0, 0.0]), ("env_plus_fn", [1.1, 0.0]), ("fn", [0.1, 0.0])])
def test_an_episode_scores_its_environment_reward_and_fn_adds_or_overrides(tmp_path, monkeypatch, with_env, scores):
    s, _ = scorer(tmp_path, monkeypatch, BONUS, with_env=with_env)
    got = s.group(RECORD, completions(["", ""]), EPISODES).scores
    assert got == pytest.approx(scores)


def test_an_episode_response_is_its_last_assistant_message_and_fn_sees_the_environment_reward(tmp_path, monkeypatch):
    source = "def fn(responses, env_rewards):\n    return [len(r) + 10 * e for r, e in zip(responses, env_rewards)]\n"
    s, _ = scorer(tmp_path, monkeypatch, source, with_env="fn")
    assert s.group(RECORD, completions(["", ""]), EPISODES).scores == [28.0, 1.0]  # len("<answer>4</answer>") + 10
