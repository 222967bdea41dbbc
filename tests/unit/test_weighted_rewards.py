"""controller.reward.fns (relayrl/rewards/weighted.py): several reward functions, the score their weighted sum, each
function's values kept apart and averaged per batch as rewards/<name>."""

from __future__ import annotations

import uuid

import pytest

from relayrl.config import ConfigError, RewardConfig, parse_config
from relayrl.controller.core import reward_means
from relayrl.controller.scoring import Scorer
from relayrl.data.dataset import PromptRecord
from relayrl.rewards.weighted import reward_name, weighted_rewards
from relayrl.v1 import common_pb2

SOURCE = """
def length(responses):
    return [float(len(r)) for r in responses]

def says_four(response, answer):
    return float(response.strip() == answer)
"""


class Chars:
    """decode_sequences' tokenizer: ids are characters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.fixture
def module(tmp_path, monkeypatch) -> str:
    name = f"weighted_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_the_score_is_the_weighted_sum_and_each_function_is_kept_apart(module) -> None:
    cfg = RewardConfig(fns={f"{module}:length": 0.5, f"{module}:says_four": 2.0, "prefix_match": -1.0})
    scorer = Scorer(cfg, Chars(), 8, row_of=lambda prompt_id: {})
    texts = ["4", "44", "5"]
    completions = [common_pb2.Completion(sample_index=i, token_ids=[ord(c) for c in t]) for i, t in enumerate(texts)]
    group = scorer.group(PromptRecord("0:1", "2 + 2 =", [1], "4"), completions)
    prefix = [float(t.startswith("4")) for t in texts]  # prefix_match: the response starts with the answer
    assert group.parts == {"length": [1.0, 2.0, 1.0], "says_four": [1.0, 0.0, 0.0], "prefix_match": prefix}
    assert group.scores == [0.5 * n + 2.0 * f - p for n, f, p in zip([1, 2, 1], [1, 0, 0], prefix)]
    assert reward_means([group, group]) == {"length": 4 / 3, "says_four": 1 / 3, "prefix_match": sum(prefix) / 3}


def test_one_function_is_fn_with_weight_one(module) -> None:
    rewards = weighted_rewards(RewardConfig(fn=f"{module}:length"))
    assert [(name, weight) for name, weight, _ in rewards.callers] == [("length", 1.0)]
    assert reward_name("pkg.mod:format_bonus") == "format_bonus" and reward_name("exact_match") == "exact_match"


def test_bad_functions_are_refused_naming_the_key(module) -> None:
    with pytest.raises(ValueError, match=r"^controller\.reward\.fns: .*nope"):
        weighted_rewards(RewardConfig(fns={f"{module}:length": 1.0, "nope": 1.0}))
    raw = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}
    for fns, words in (({"a:score": 1.0, "b:score": 1.0}, "share a name"), ({"exact_match": float("nan")}, "finite")):
        with pytest.raises(ConfigError, match=words):
            parse_config({**raw, "controller": {"reward": {"fns": fns}}})
