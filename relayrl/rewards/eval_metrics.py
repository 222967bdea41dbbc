"""Eval metrics: pure functions of the rewards (and extracted answers) of n samples per prompt.

A sample *passes* when its reward is >= the pass threshold (``eval.pass_threshold``; unset, ``full_marks`` of
``controller.reward``: 1.0 for one 0/1 function; a graded reward says there what counts as right). Per prompt with
n samples of which c pass, averaged over the prompts:

- ``mean@n``: the mean reward of the n samples (graded rewards count as they are, not thresholded);
- ``pass@k`` (k <= n): 1 - C(n - c, k) / C(n, k), the unbiased estimator of "at least one of k samples passes"
  (Chen et al. 2021), computed as the product 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms a binomial
  coefficient (no overflow, no cancellation);
- ``pass^k`` (k <= n): C(c, k) / C(n, k) = prod_{i=0}^{k-1} (c - i) / (n - i), the unbiased estimator of "all of k
  samples pass" (tau-bench);
- ``maj@n``: the prompt passes when a sample whose answer is the most frequent extracted answer passes (ties: the
  answer seen first; samples without an extractable answer do not vote; none: the prompt fails).

With several reward functions (``controller.reward.fns``) the metrics are of the weighted score, and each
function's ``mean@n``, ``pass@k`` and ``pass^k`` of its own values are reported beside them as ``<name>/<metric>``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from relayrl.config import RewardConfig
from relayrl.registry import Registry
from relayrl.rewards.builtin import extract_math_answer, normalize, normalize_number

METRIC_FAMILIES = ("mean", "pass", "pass^", "maj")  # what eval.metrics may name
PER_FUNCTION = ("mean", "pass", "pass^")  # the families reported per reward function (maj@n votes on the response)
ANSWER_EXTRACTORS: Registry = Registry("answer extractor")
# the extractor maj@n uses when eval.answer_extractor is unset, by reward function (others must name one)
DEFAULT_EXTRACTOR = {"exact_match": "normalized", "math": "math"}


@ANSWER_EXTRACTORS.register("normalized")
def normalized_answer(response: str) -> str | None:
    """The whole response, whitespace collapsed, lowercased, trailing period dropped (exact_match's view)."""
    return normalize(response) or None


@ANSWER_EXTRACTORS.register("first_word")
def first_word(response: str) -> str | None:
    """The response's first whitespace-separated word, normalized (prefix_match-style tasks)."""
    words = normalize(response).split()
    return words[0] if words else None


@ANSWER_EXTRACTORS.register("math")
def math_answer(response: str) -> str | None:
    r"""The ``\boxed{}`` / ``####`` answer as a normalized number (the math reward's view), None without one."""
    found = extract_math_answer(response)
    return normalize_number(found) if found is not None else None


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn without replacement, hold a pass."""
    _check(n, c, k)
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_hat_k(n: int, c: int, k: int) -> float:
    """C(c, k) / C(n, k): the chance that k of the n samples, drawn without replacement, all pass (pass^k)."""
    _check(n, c, k)
    hit = 1.0
    for i in range(k):
        hit *= (c - i) / (n - i)
    return max(hit, 0.0)


def _check(n: int, c: int, k: int) -> None:
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")


def majority_index(answers: Sequence[str | None]) -> int | None:
    """The index of the first sample whose answer is the most frequent one (ties: the one seen first); None when
    no sample has an answer."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(i for i, a in enumerate(answers) if a is not None and votes[a] == top)


def metric_names(families: Sequence[str], n: int, ks: Sequence[int], functions: Sequence[str] = ()) -> list[str]:
    """The metric keys ``families`` produce for n samples and the k values: mean@n, pass@k, pass^k, maj@n; then
    each of ``functions`` (``controller.reward.fns``' names) as ``<name>/<metric>`` (``function_metrics``)."""
    names = _family_names(families, n, ks)
    per_function = _family_names([f for f in families if f in PER_FUNCTION], n, ks)
    return names + [f"{name}/{metric}" for name in functions for metric in per_function]


def _family_names(families: Sequence[str], n: int, ks: Sequence[int]) -> list[str]:
    names = []
    for family in families:
        if family in ("mean", "maj"):
            names.append(f"{family}@{n}")
        elif family == "pass":
            names += [f"pass@{k}" for k in ks]
        elif family == "pass^":
            names += [f"pass^{k}" for k in ks]
        else:
            raise ValueError(f"unknown metric family {family!r} (known: {', '.join(METRIC_FAMILIES)})")
    return names


def prompt_metrics(
    rewards: Sequence[float],
    families: Sequence[str],
    ks: Sequence[int],
    threshold: float,
    answers: Sequence[str | None] | None = None,
) -> dict[str, float]:
    """One prompt's metrics from the rewards of its n samples (``answers``: their extracted answers, for maj@n)."""
    n = len(rewards)
    c = sum(r >= threshold for r in rewards)
    out: dict[str, float] = {}
    for family in families:
        if family == "mean":
            out[f"mean@{n}"] = sum(rewards) / n
        elif family == "pass":
            out.update({f"pass@{k}": pass_at_k(n, c, k) for k in ks})
        elif family == "pass^":
            out.update({f"pass^{k}": pass_hat_k(n, c, k) for k in ks})
        elif family == "maj":
            if answers is None:
                raise ValueError("maj@n needs the samples' extracted answers")
            i = majority_index(answers)
            out[f"maj@{n}"] = float(i is not None and rewards[i] >= threshold)
    return out


def function_metrics(
    parts: Mapping[str, Sequence[float]], families: Sequence[str], ks: Sequence[int], threshold: float
) -> dict[str, float]:
    """One prompt's metrics of each reward function alone (``controller.reward.fns``: ``parts`` maps a function's
    name to its unweighted values), keyed ``<name>/<metric>``, for the families in ``PER_FUNCTION``."""
    kept = [f for f in families if f in PER_FUNCTION]
    return {
        f"{name}/{metric}": value
        for name, values in parts.items()
        for metric, value in prompt_metrics(values, kept, ks, threshold).items()
    }


def average(per_prompt: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of each metric over the prompts (empty input: empty output)."""
    if not per_prompt:
        return {}
    return {key: sum(p[key] for p in per_prompt) / len(per_prompt) for key in per_prompt[0]}


def extractor(name: str) -> Callable[[str], str | None]:
    return ANSWER_EXTRACTORS.get(name)


def reward_extractor(reward: RewardConfig) -> str | None:
    """maj@n's extractor when ``eval.answer_extractor`` is unset: the ``DEFAULT_EXTRACTOR`` of the functions that
    score (``controller.reward.fns`` when set, else ``fn``) when those that have one agree on it (a format bonus
    beside ``math`` has none: ``math``'s); None when none has one or two differ (the config must name one)."""
    found = {DEFAULT_EXTRACTOR[name] for name in reward.fns or [reward.fn] if name in DEFAULT_EXTRACTOR}
    return found.pop() if len(found) == 1 else None


def full_marks(reward: RewardConfig, episodic: bool = False) -> float:
    """The score of full marks, the default pass threshold, with each function's and the environment's full marks 1:
    ``fn`` alone 1; ``controller.reward.fns`` the sum of their positive weights (w_1 x 1 + w_2 x 1 + ...; weights
    summing below 1 never reach 1.0); an episode's by ``with_env``: env 1, env_plus_fn 1 + the functions', fn the
    functions'."""
    functions = sum(w for w in reward.fns.values() if w > 0) if reward.fns else 1.0
    if not episodic:
        return functions
    return {"env": 1.0, "env_plus_fn": 1.0 + functions, "fn": functions}[reward.with_env]
