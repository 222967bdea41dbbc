"""The per-step version metrics count each sampled token under the version that sampled it."""

from __future__ import annotations

from relayrl.algorithms.version_mix import version_mix
from relayrl.v1 import controller_pb2


def sample(tokens: int, version: int, token_versions=(), loss_mask=b"") -> controller_pb2.Sample:
    return controller_pb2.Sample(
        response_token_ids=[5] * tokens, policy_version=version, token_versions=token_versions, loss_mask=loss_mask
    )


def test_tokens_are_counted_by_the_version_that_sampled_them() -> None:
    samples = [
        sample(4, 6),  # no per-token versions: all four by 6 (the step trains from 7: lag 1)
        sample(3, 7),
        sample(5, 6, token_versions=[6, 6, 7, 7, 7]),  # lived through an update to 7
        sample(4, 5, token_versions=[5, 5, 7, 7], loss_mask=b"\x01\x00\x00\x01"),  # masked tokens do not count
    ]
    metrics = version_mix(samples, version=7)
    assert metrics["tokens_lag_0"] == 3 + 3 + 1 and metrics["tokens_lag_1"] == 4 + 2 and metrics["tokens_lag_2"] == 1
    assert metrics["stale_token_share"] == 7 / 14
    assert metrics["token_lag_max"] == 2.0 and metrics["mixed_version_samples"] == 2.0


def test_an_on_policy_batch_has_no_stale_tokens() -> None:
    metrics = version_mix([sample(3, 2), sample(1, 2)], version=2)
    assert metrics == {
        "tokens_lag_0": 4.0,
        "stale_token_share": 0.0,
        "token_lag_max": 0.0,
        "mixed_version_samples": 0.0,
    }
