"""Eval metrics: unbiased pass@k and pass^k against their binomial definitions on every small case, mean@n of graded
rewards, the pass threshold, maj@n's vote, and the answer extractors."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from relayrl.rewards.eval_metrics import (
    average,
    extractor,
    majority_index,
    metric_names,
    pass_at_k,
    pass_hat_k,
    prompt_metrics,
)

SMALL = [(n, c, k) for n in range(1, 9) for c in range(n + 1) for k in range(1, n + 1)]


@pytest.mark.parametrize(("n", "c", "k"), SMALL)
def test_pass_at_k_is_one_minus_the_binomial_ratio_on_every_small_case(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), SMALL)
def test_pass_hat_k_is_the_all_pass_binomial_ratio_on_every_small_case(n: int, c: int, k: int) -> None:
    assert pass_hat_k(n, c, k) == pytest.approx(comb(c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_stays_exact_where_the_binomials_overflow_a_float() -> None:
    n, c, k = 2000, 3, 700  # C(2000, 700) ~ 1e566: beyond a double
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_hat_k(n, c, 2) == pytest.approx(float(Fraction(comb(c, 2), comb(n, 2))), rel=1e-12)


def test_one_right_answer_in_four_is_pass_at_4_of_one_not_a_bootstrap_estimate() -> None:
    """verl's bootstrapped best@4 reads ~0.68 here; the closed form gives the certainty that 4 of 4 hold the pass."""
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, 1, 4), (3, 1, 0), (3, -1, 1)])
def test_impossible_counts_are_refused(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(n, c, k)


def test_graded_rewards_pass_at_the_threshold_and_mean_counts_them_as_they_are() -> None:
    rewards = [0.1, 0.5, 0.9, 1.0]
    strict = prompt_metrics(rewards, ["mean", "pass", "pass^"], [1, 2], threshold=1.0)
    assert strict == {
        "mean@4": pytest.approx(0.625),
        "pass@1": 0.25,
        "pass@2": pytest.approx(0.5),
        "pass^1": 0.25,
        "pass^2": 0.0,
    }
    lenient = prompt_metrics(rewards, ["pass", "pass^"], [2], threshold=0.5)  # 3 of 4 pass
    assert lenient == {"pass@2": 1.0, "pass^2": pytest.approx(comb(3, 2) / comb(4, 2))}


def test_maj_passes_when_the_most_voted_answer_passes() -> None:
    answers = ["7", "3", "7", None]
    assert majority_index(answers) == 0
    assert prompt_metrics([1.0, 0.0, 1.0, 0.0], ["maj"], [], 1.0, answers) == {"maj@4": 1.0}
    assert prompt_metrics([0.0, 1.0, 0.0, 0.0], ["maj"], [], 1.0, answers) == {"maj@4": 0.0}  # right, outvoted
    assert majority_index(["a", "b"]) == 0  # a tie: the answer seen first
    assert majority_index([None, None]) is None
    assert prompt_metrics([1.0, 1.0], ["maj"], [], 1.0, [None, None]) == {"maj@2": 0.0}


def test_metric_names_and_the_average_over_prompts() -> None:
    assert metric_names(["mean", "pass", "pass^", "maj"], 4, [1, 4]) == [
        "mean@4", "pass@1", "pass@4", "pass^1", "pass^4", "maj@4",
    ]  # fmt: skip
    assert average([{"pass@1": 1.0}, {"pass@1": 0.0}, {"pass@1": 0.5}]) == {"pass@1": 0.5}
    assert average([]) == {}


def test_answer_extractors() -> None:
    assert extractor("normalized")("  The Answer. ") == "the answer"
    assert extractor("first_word")("4 then more") == "4"
    assert extractor("first_word")("   ") is None
    assert extractor("math")(r"so \boxed{1,000}") == "1000"
    assert extractor("math")("no answer here") is None
    with pytest.raises(KeyError, match="unknown answer extractor"):
        extractor("nope")
