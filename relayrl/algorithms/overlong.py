"""DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13). Plain Python floats."""

from __future__ import annotations

import math
import operator


def _as_int(name: str, value: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def overlong_penalty(response_len: int, max_response_len: int, buffer_len: int, penalty_factor: float = 1.0) -> float:
    """Length penalty added to the reward, with L = response_len, Lmax = max_response_len, Lc = buffer_len:

        R = 0                                  if L <= Lmax - Lc
        R = ((Lmax - Lc) - L) / Lc · factor    if Lmax - Lc < L <= Lmax     (linear from 0 to -factor)
        R = -factor                            if L > Lmax

    Requires 0 <= buffer_len <= max_response_len, max_response_len > 0, response_len >= 0,
    penalty_factor >= 0 (ValueError naming the field otherwise). With buffer_len = 0 the middle region is
    empty.
    """
    length = _as_int("response_len", response_len)
    lmax = _as_int("max_response_len", max_response_len)
    lcache = _as_int("buffer_len", buffer_len)
    factor = float(penalty_factor)
    if length < 0:
        raise ValueError(f"response_len: must be >= 0, got {length}")
    if lmax <= 0:
        raise ValueError(f"max_response_len: must be > 0, got {lmax}")
    if lcache < 0:
        raise ValueError(f"buffer_len: must be >= 0, got {lcache}")
    if lcache > lmax:
        raise ValueError(f"buffer_len: must be <= max_response_len ({lmax}), got {lcache}")
    if not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"penalty_factor: must be a finite number >= 0, got {penalty_factor}")

    expected = lmax - lcache
    if length <= expected:
        return 0.0
    if length <= lmax:
        return (expected - length) / lcache * factor
    return -factor
