"""Pure RL math (plain torch, no Dask): the advantage estimator registry (GAE, GRPO, RLOO: `estimators`) and the
specs of what each algorithm needs (`specs`: plain data, no torch), granularity helpers, PPO losses, the tie rule
of every std normalisation (`ties`).

The names below are imported from their modules on first use (PEP 562 `__getattr__`), so importing
`tasks.algorithms.specs` (which the offline config checks do: tasks.config) imports no torch.
"""
from __future__ import annotations

import importlib

# name -> the module of this package that defines it
_NAMES = {
    "advantages": ("from_action_level", "gae", "to_action_level"),
    "estimators": ("Estimator", "estimator_names", "get_estimator", "register_estimator"),
    "granularity": ("LOGPROB_TYPES", "REWARD_TYPES", "aggregate_rewards", "check_granularity", "expand_advantages",
                    "loss_mask_for", "reduce_logprobs"),
    "grpo": ("check_groups", "grpo_advantages"),
    "losses": ("REDUCTIONS", "aggregate_loss", "critic_loss", "decoupled_ppo_actor_loss", "entropy_bonus",
               "masked_mean", "normalize_advantages", "ppo_actor_loss"),
    "ties": ("TIE_ULPS", "is_tie", "tie_tolerance"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}
__all__ = [name for names in _NAMES.values() for name in names]


def __getattr__(name: str):
    """`tasks.algorithms.<name>`: a name of `__all__` from its module (imported now), or a submodule.

    Raises:
        AttributeError: neither."""
    if name in _NAMES or name in ("rloo", "specs"):
        return importlib.import_module(f"{__name__}.{name}")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
