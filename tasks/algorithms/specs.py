"""What each algorithm (`algorithm.name`) needs and how it normalises: the estimator specs, beside the estimators'
math (`tasks.algorithms.estimators` registers each estimator under its spec's name and refuses a name without one).

The offline checks read these specs (`tasks.config`: `AlgorithmConfig.spec`, the inert keys), so this module is
plain data: it imports nothing of dagrl and no torch (importing it runs `tasks/algorithms/__init__.py`, which imports
its torch modules lazily), and it is the one module of tasks outside tasks.config that tasks.config may import
(pyproject's import-linter contract). Callers ask the spec (`AlgorithmConfig.spec`) or the estimator, never the name;
`tasks.config.estimator_spec` looks a name up (ConfigError for an unknown one).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorSpec:
    """What an advantage estimator needs from the rollout and the config, and how its advantages are normalised.

    `algorithm.name` selects one (`ALGORITHMS`; `sft` is the one algorithm without an estimator). The math is
    registered under the same name in `tasks.algorithms.estimators` (`register_estimator`, which refuses a name
    without a spec here). Callers ask the spec (`AlgorithmConfig.spec`) or the estimator, never the name.
    """

    name: str  # the algorithm.name that selects it
    advantage: str  # the estimator's own name (gae, grpo): what a saved config's former algorithm.adv_type said
    label: str  # for messages: "PPO", "GRPO"
    summary: str  # one clause for messages: what it needs and how it normalises
    critic: bool  # trains a value function: value loss, and reads values / final_values / bootstrap_values
    groups: bool  # envs in groups of algorithm.group_size sharing every reset seed, scored against each other
    whole_episodes: bool  # scores each env's first episode from the rollout's first chunk step (check_whole_episodes)
    normalisation: str  # "batch": over the update's whole batch when algorithm.normalize_advantages; "group": inside
    # the estimator, per group (normalize_advantages is not read)
    keys: tuple[str, ...]  # the algorithm.* keys it reads among those some estimator does not (ESTIMATOR_KEYS)
    estimator: bool = True  # an advantage estimator is registered under `name` (tasks.algorithms.estimators)
    rollout: bool = True  # a training step rolls the policy out in the training envs (env.num_envs, rollout.*)


ESTIMATORS: dict[str, EstimatorSpec] = {s.name: s for s in (
    EstimatorSpec(name="ppo", advantage="gae", label="PPO",
                  summary="PPO trains a critic and normalises GAE advantages over the whole batch",
                  critic=True, groups=False, whole_episodes=False, normalisation="batch",
                  keys=("gamma", "gae_lambda", "value_coef", "value_clip", "critic_lr", "critic_warmup_steps",
                        "normalize_advantages")),
    EstimatorSpec(name="grpo", advantage="grpo", label="GRPO",
                  summary="GRPO is critic-free (no value loss), without GAE, and normalises its advantages within "
                          "each group",
                  critic=False, groups=True, whole_episodes=True, normalisation="group",
                  keys=("group_size", "filter_rewards", "rewards_lower_bound", "rewards_upper_bound")),
    EstimatorSpec(name="rloo", advantage="rloo", label="RLOO",
                  summary="RLOO is critic-free (no value loss), without GAE, and baselines each episode score with "
                          "the mean of the other members of its group",
                  critic=False, groups=True, whole_episodes=True, normalisation="batch",
                  keys=("group_size", "normalize_advantages")),
)}
ESTIMATOR_KEYS: tuple[str, ...] = tuple(sorted({k for s in ESTIMATORS.values() for k in s.keys}))
NORMALISATIONS = ("batch", "group")

# behaviour cloning from sft.store: an algorithm like the others, whose spec says it has no estimator and rolls
# nothing out (its steps read the store; evaluation uses env.eval.*)
SFT = EstimatorSpec(name="sft", advantage="", label="SFT",
                    summary="SFT clones the episodes of sft.store: no rollouts, no estimator",
                    critic=False, groups=False, whole_episodes=False, normalisation="batch", keys=(),
                    estimator=False, rollout=False)
ALGORITHMS: dict[str, EstimatorSpec] = {**ESTIMATORS, SFT.name: SFT}  # algorithm.name -> its spec

