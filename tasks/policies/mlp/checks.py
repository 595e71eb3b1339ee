"""The mlp family's rules (functions of the whole Config; raise ConfigError)."""
from __future__ import annotations

from tasks.config.errors import ConfigError

ACTIVATIONS = ("gelu", "relu", "tanh")  # tasks.policies.mlp.model.ACTIVATIONS (a test keeps them equal)


def check_sizes(cfg) -> None:
    p = cfg.policy
    if not (len(p.hidden_sizes) > 0 and min(p.hidden_sizes) > 0):
        raise ConfigError("policy.hidden_sizes", p.hidden_sizes, "needs at least one layer, all sizes >= 1")
    if p.activation not in ACTIVATIONS:
        raise ConfigError("policy.activation", p.activation, f"use one of {sorted(ACTIVATIONS)}")


def check_fresh(cfg) -> None:
    """The mlp starts fresh and has one learning rate."""
    p, a = cfg.policy, cfg.algorithm
    if p.model_path is not None:
        raise ConfigError("policy.model_path", p.model_path,
                          "the mlp policy starts fresh; model_path is for VLAs (flow_vla, token_vla)")
    if a.critic_lr is not None:
        raise ConfigError("algorithm.critic_lr", a.critic_lr, "is for VLAs' value heads; the mlp has one lr: null")


CHECKS = (check_sizes, check_fresh)
