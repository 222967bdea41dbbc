"""Several reward functions with weights (``controller.reward.fns``, TRL's ``reward_funcs`` + ``reward_weights``):
a response's score is sum_i w_i x f_i(response), each f_i's value kept apart (logged as ``rewards/<name>``).

A function's name is its registry name, or the function part of ``module:function``; a served reward
(``scorer:<name>``, relayrl/rewards/served.py) is named by its scorer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from relayrl.config import SCORER_PREFIX, RewardConfig, ScorerConfig
from relayrl.rewards.call import GroupInputs, RewardCaller, load_reward
from relayrl.rewards.served import ScorerClient
from relayrl.rewards.signature import RewardSignature


def reward_name(spec: str) -> str:
    """``exact_match`` -> ``exact_match``; ``pkg.mod:format_bonus`` -> ``format_bonus``."""
    return spec.rpartition(":")[2]


@dataclass(frozen=True)
class WeightedRewards:
    """``rewards(group) -> (scores, parts)``: each response's weighted sum, and each function's values by name."""

    callers: tuple[tuple[str, float, RewardCaller], ...]  # (name, weight, caller)
    served: dict[str, ScorerClient] = field(default_factory=dict)  # the served rewards' clients, by name

    def wants(self, argument: str) -> bool:
        """Some function asks for ``argument`` (``row``: the dataset row is read only then)."""
        return any(caller.signature.wants(argument) for _, _, caller in self.callers)

    def __call__(self, group: GroupInputs) -> tuple[list[float], dict[str, list[float]]]:
        parts = {name: caller(group) for name, _, caller in self.callers}
        scores = [0.0] * len(group.responses)
        for name, weight, _ in self.callers:
            scores = [s + weight * v for s, v in zip(scores, parts[name], strict=True)]
        return scores, parts


def served_reward(client: ScorerClient) -> RewardCaller:
    """A batched reward function of the conversations that asks ``client``'s scorer."""
    return RewardCaller(client.score, client.name, RewardSignature(batched=True, keywords=("conversations",)))


def weighted_rewards(cfg: RewardConfig, scorers: Mapping[str, ScorerConfig] | None = None) -> WeightedRewards:
    """The start-up check and the callers of ``controller.reward``: ``fns`` (each weighted), else ``fn`` with weight 1;
    ``scorers``: the run's, which ``scorer:<name>`` keys name (None: a start-up check before the scorers have
    addresses; those keys are left out, the config checked their names). ValueError starting with the key when a
    function does not resolve or has no form."""
    specs = cfg.fns or {cfg.fn: 1.0}
    key = "controller.reward.fns" if cfg.fns else "controller.reward.fn"
    callers, served = [], {}
    for spec, weight in specs.items():
        try:
            if spec.startswith(SCORER_PREFIX):
                if scorers is not None:
                    name = spec.removeprefix(SCORER_PREFIX)
                    served[name] = ScorerClient(name, scorers[name])
                    callers.append((name, weight, served_reward(served[name])))
                continue
            callers.append((reward_name(spec), weight, load_reward(spec, cfg.form)))
        except (KeyError, ValueError) as err:
            raise ValueError(f"{key}: {err.args[0]}") from None
    return WeightedRewards(tuple(callers), served)
