"""Policy families behind one registry with a uniform constructor.

Every policy is an `nn.Module` with:
  act(obs [B, O], deterministic) -> {"actions" [B, C, D], "logprobs" [B, C, D], "values" [B] or [B, C]}
  evaluate(obs [N, O], actions [N, C, D]) -> {"logprobs" [N, C, D], "entropy" [N, C, D], "values" ...}
  values(obs [B, O]) -> [B] or [B, C]
Families are imported lazily so heavy dependencies (transformers for VLAs) stay optional.
"""
from __future__ import annotations

import importlib

import torch

from tasks.config import ConfigError, PolicyConfig

_POLICIES: dict[str, tuple[str, str]] = {"mlp": ("tasks.policies.mlp", "MLPPolicy")}


def make_policy(cfg: PolicyConfig, *, obs_dim: int, action_dim: int, num_values: int = 1,
                seed: int | None = None) -> torch.nn.Module:
    """Build a policy by `cfg.name`; `seed` makes the initial parameters reproducible.

    Raises:
        ConfigError: unknown policy name (lists the known ones).
    """
    if cfg.name not in _POLICIES:
        raise ConfigError("policy.name", cfg.name, f"known policies: {sorted(_POLICIES)}")
    module, cls = _POLICIES[cfg.name]
    if seed is not None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return getattr(importlib.import_module(module), cls)(cfg, obs_dim, action_dim, num_values)
    return getattr(importlib.import_module(module), cls)(cfg, obs_dim, action_dim, num_values)


def check_policy_config(cfg: PolicyConfig) -> None:
    """Offline checks of a policy config. Raises ConfigError."""
    if cfg.name not in _POLICIES:
        raise ConfigError("policy.name", cfg.name, f"known policies: {sorted(_POLICIES)}")
    if cfg.name == "mlp":
        from tasks.policies.mlp import ACTIVATIONS
        if cfg.activation not in ACTIVATIONS:
            raise ConfigError("policy.activation", cfg.activation, f"use one of {sorted(ACTIVATIONS)}")
