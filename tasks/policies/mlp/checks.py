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


def check_one_lr(cfg) -> None:
    """The mlp has one learning rate. (It starts fresh or from `policy.model_path`, an mlp export: checked against
    the config by pipelines.components.check_model_path, as every family's.)"""
    a = cfg.algorithm
    if a.critic_lr is not None:
        raise ConfigError("algorithm.critic_lr", a.critic_lr, "is for VLAs' value heads; the mlp has one lr: null")


CHECKS = (check_sizes, check_one_lr)
