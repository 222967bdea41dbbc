"""Built-in verifiable rewards and the plug-in lookup."""

from __future__ import annotations

import re
from collections.abc import Callable

from relayrl.imports import import_attr
from relayrl.registry import Registry

RewardFn = Callable[[str, str], float]
REWARDS: Registry = Registry("reward function")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize(text: str) -> str:
    """Collapse whitespace, strip, lowercase, drop a trailing period."""
    return " ".join(text.split()).strip().lower().rstrip(".")


def normalize_number(text: str) -> str:
    """'1,000.50' -> '1000.5'; non-numbers are only stripped."""
    cleaned = text.replace(",", "").replace("$", "").strip()
    try:
        value = float(cleaned)
    except ValueError:
        return cleaned
    return str(int(value)) if value.is_integer() else repr(value)


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}``, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_math_answer(text: str) -> str | None:
    r"""The final answer of a math response: ``\boxed{x}``, else what follows ``####``, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        match = _NUMBER.search(text.split("####")[-1])
        return match.group(0) if match else text.split("####")[-1].strip()
    return None


@REWARDS.register("exact_match")
def exact_match(response: str, answer: str) -> float:
    """1.0 when the normalized response equals the normalized answer, else 0.0."""
    return float(normalize(response) == normalize(answer))


@REWARDS.register("prefix_match")
def prefix_match(response: str, answer: str) -> float:
    """1.0 when the normalized response starts with the normalized (non-empty) answer."""
    expected = normalize(answer)
    return float(bool(expected) and normalize(response).startswith(expected))


@REWARDS.register("math")
def math_answer(response: str, answer: str) -> float:
    r"""1.0 when the ``\boxed{}`` / ``####`` answer equals the reference numerically (or as text)."""
    predicted = extract_math_answer(response)
    if predicted is None:
        return 0.0
    reference = extract_math_answer(answer) or answer
    return float(normalize_number(predicted) == normalize_number(reference))


@REWARDS.register("last_number")
def last_number(response: str, answer: str) -> float:
    """1.0 when the last number in the response equals the reference numerically ("7", "3 + 4 = 7.", "The sum is
    7" pass for 7; "7, since 3 + 4" does not: its last number is 4), else 0.0."""
    numbers = _NUMBER.findall(response)
    return float(bool(numbers) and normalize_number(numbers[-1]) == normalize_number(answer))


def resolve_reward(spec: str) -> RewardFn:
    """A registered name, or ``module:function`` imported on the spot. Raises ValueError naming spec."""
    if ":" not in spec:
        return REWARDS.get(spec)
    fn = import_attr(spec, "reward function")  # SpecImportError (a ValueError): one line naming spec
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn
