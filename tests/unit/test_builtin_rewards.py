"""The registered reward functions that read numbers out of a response."""

from __future__ import annotations

import pytest

from relayrl.rewards import resolve_reward


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("7", "7", 1.0),
        ("3 + 4 = 7.", "7", 1.0),
        ("The sum is 7", "7", 1.0),
        ("3 + 4 = 10 apples", "10", 1.0),
        ("7, since 3 + 4", "7", 0.0),  # its last number is 4: the answer has to come last
        ("seven", "7", 0.0),
        ("", "7", 0.0),
        ("-7", "7", 0.0),
    ],
)
def test_last_number_scores_the_last_number_of_the_response(response: str, answer: str, reward: float) -> None:
    assert resolve_reward("last_number")(response, answer) == reward
