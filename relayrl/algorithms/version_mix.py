"""Which policy versions sampled a batch's tokens: the per-step metrics of in-flight weight updates.

A sampled token's version is ``Sample.token_versions[i]`` (empty: every token was sampled by
``Sample.policy_version``); only tokens with loss mask 1 count (an episode's observation tokens were not
sampled). For the step trained from version ``v`` (its starting weights), a token's lag is ``v - version``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from relayrl.v1 import controller_pb2


def sampled_versions(sample: controller_pb2.Sample) -> list[int]:
    """The version of each sampled (loss-masked) response token of ``sample``, in order."""
    count = len(sample.response_token_ids)
    versions = list(sample.token_versions) if sample.token_versions else [sample.policy_version] * count
    if not sample.loss_mask:
        return versions
    return [v for v, m in zip(versions, sample.loss_mask, strict=True) if m]


def version_mix(samples: Iterable[controller_pb2.Sample], version: int) -> dict[str, float]:
    """Metrics of a batch trained from ``version``:

    - ``tokens_lag_<k>``: sampled tokens whose version is ``version - k`` (one key per lag present);
    - ``stale_token_share``: share of sampled tokens older than ``version`` (lag > 0);
    - ``token_lag_max``: the largest lag (0 when every token is on-policy);
    - ``mixed_version_samples``: samples whose tokens carry more than one version (a row that lived through an
      in-flight weight update).
    """
    lags: Counter[int] = Counter()
    mixed = 0
    for sample in samples:
        versions = sampled_versions(sample)
        lags.update(version - v for v in versions)
        mixed += len(set(versions)) > 1
    tokens = sum(lags.values())
    out = {f"tokens_lag_{lag}": float(count) for lag, count in sorted(lags.items())}
    out["stale_token_share"] = sum(c for lag, c in lags.items() if lag > 0) / max(tokens, 1)
    out["token_lag_max"] = float(max(lags, default=0))
    out["mixed_version_samples"] = float(mixed)
    return out
