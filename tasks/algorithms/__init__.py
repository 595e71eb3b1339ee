"""Pure RL math (plain torch, no Dask): the advantage estimator registry (GAE, GRPO: `estimators`), granularity
helpers, PPO losses, the tie rule of every std normalisation (`ties`)."""

from tasks.algorithms.advantages import from_action_level, gae, to_action_level
from tasks.algorithms.estimators import Estimator, estimator_names, get_estimator, register_estimator
from tasks.algorithms.granularity import (
    LOGPROB_TYPES,
    REWARD_TYPES,
    aggregate_rewards,
    check_granularity,
    expand_advantages,
    loss_mask_for,
    reduce_logprobs,
)
from tasks.algorithms.grpo import check_groups, grpo_advantages
from tasks.algorithms.losses import (
    REDUCTIONS,
    aggregate_loss,
    critic_loss,
    decoupled_ppo_actor_loss,
    entropy_bonus,
    masked_mean,
    normalize_advantages,
    ppo_actor_loss,
)
from tasks.algorithms.ties import TIE_ULPS, is_tie, tie_tolerance

__all__ = [
    "Estimator",
    "estimator_names",
    "get_estimator",
    "register_estimator",
    "from_action_level",
    "gae",
    "to_action_level",
    "check_groups",
    "grpo_advantages",
    "LOGPROB_TYPES",
    "REWARD_TYPES",
    "aggregate_rewards",
    "check_granularity",
    "expand_advantages",
    "loss_mask_for",
    "reduce_logprobs",
    "REDUCTIONS",
    "aggregate_loss",
    "critic_loss",
    "decoupled_ppo_actor_loss",
    "entropy_bonus",
    "masked_mean",
    "normalize_advantages",
    "ppo_actor_loss",
    "TIE_ULPS",
    "is_tie",
    "tie_tolerance",
]
