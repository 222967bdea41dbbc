"""RL algorithm pieces as pure tensor-in, tensor-out functions, in registries by name (as verl's core_algos).

- advantages: ADVANTAGE_ESTIMATORS (grpo, rloo, reinforce_pp, reinforce_pp_baseline; gae from gae.py)
- gae: gae_advantages (GAE with a learned critic, multi-turn masks), terminal_rewards, masked_whiten
- value_loss: clipped_value_loss, explained_variance (the critic's loss and its quality)
- policy_loss: POLICY_LOSSES (ppo_clip, with clip-higher and dual-clip; gspo, the sequence-level ratio)
- aggregation: LOSS_AGGREGATIONS / agg_loss (token-mean, seq-mean-token-sum, seq-mean-token-mean,
  seq-mean-token-sum-norm)
- kl: KL_ESTIMATORS / kl_penalty (k1, k2, k3)
- rollout_correction: IS_LEVELS (token, sequence, geometric), RS_LEVELS (token, seq_sum, seq_mean, seq_max),
  importance_weights, rejection_keep, icepop, apply_correction, diagnostic_sums / rollout_diagnostics (the
  engine-trainer mismatch: rollout IS, rejection, and their diagnostics)
- overlong: overlong_penalty (DAPO soft overlong punishment)
- dynamic_sampling: GroupFiller, group_is_informative, DynamicSamplingExhausted (DAPO dynamic sampling)
- logprobs: logprobs_from_logits, entropy_from_logits

Offline and scoring losses (SFT, preference tuning, reward models, distillation):
- reward_loss: REWARD_LOSSES (bradley_terry: optional margin, TRL's center_rewards_coefficient)
- preference_loss: PREFERENCE_LOSSES (sigmoid: DPO, conservative DPO with label_smoothing; ipo), sequence_logprobs
- kto_loss: kto_loss, kto_reference_point, mismatched_completions (KTO, unpaired)
- sft_loss: sft_loss, token_accuracy, pad_examples / pack_examples (the loss's two equal layouts)
- distill: distill_advantage (on-policy distillation's per-token reverse KL), mean_reverse_kl (its step metric),
  with_task_advantage (a task reward's advantage added to it)
"""

from relayrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    grpo_advantage,
    reinforce_pp_advantage,
    reinforce_pp_baseline_advantage,
    rloo_advantage,
)
from relayrl.algorithms.aggregation import LOSS_AGGREGATIONS, agg_loss, masked_mean, masked_sum
from relayrl.algorithms.distill import distill_advantage, mean_reverse_kl, with_task_advantage
from relayrl.algorithms.dynamic_sampling import (
    DynamicSamplingExhausted,
    GroupFiller,
    group_is_informative,
)
from relayrl.algorithms.gae import gae_advantages, masked_whiten, terminal_rewards
from relayrl.algorithms.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_penalty
from relayrl.algorithms.kto_loss import kto_loss, kto_reference_point, mismatched_completions
from relayrl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
from relayrl.algorithms.overlong import overlong_penalty
from relayrl.algorithms.policy_loss import POLICY_LOSSES, compute_policy_loss, gspo_loss, ppo_clip_loss
from relayrl.algorithms.preference_loss import (
    PREFERENCE_LOSSES,
    compute_preference_loss,
    dpo_sigmoid_loss,
    ipo_loss,
    sequence_logprobs,
)
from relayrl.algorithms.reward_loss import REWARD_LOSSES, bradley_terry_loss
from relayrl.algorithms.sft_loss import SFTBatch, pack_examples, pad_examples, sft_loss, token_accuracy
from relayrl.algorithms.value_loss import clipped_value_loss, explained_variance
from relayrl.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "REWARD_LOSSES",
    "DynamicSamplingExhausted",
    "GroupFiller",
    "Registry",
    "SFTBatch",
    "agg_loss",
    "bradley_terry_loss",
    "clipped_value_loss",
    "compute_advantages",
    "compute_policy_loss",
    "compute_preference_loss",
    "distill_advantage",
    "dpo_sigmoid_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "group_is_informative",
    "grpo_advantage",
    "gspo_loss",
    "ipo_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "kto_loss",
    "kto_reference_point",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "mean_reverse_kl",
    "mismatched_completions",
    "overlong_penalty",
    "pack_examples",
    "pad_examples",
    "ppo_clip_loss",
    "reinforce_pp_advantage",
    "reinforce_pp_baseline_advantage",
    "rloo_advantage",
    "sequence_logprobs",
    "sft_loss",
    "terminal_rewards",
    "token_accuracy",
    "with_task_advantage",
]
