"""Policy families behind one registry with a uniform constructor (the Policy protocol).

Observations are a dict of batched tensors (every key optional except "state"):
  "state"  float32 [B, O]        the env's flat state vector
  "rgb"    uint8   [B, H, W, 3]  one camera image (env.obs_mode=rgb), H = W = env.image_size
  "prompt" int64   [B, L]        instruction tokens from `policy.tokenize(texts)` (VLAs; `needs_prompt` True)

Every policy is an `nn.Module` with:
  act(obs, deterministic=False) -> {"actions" [B, C, D] f32, "logprobs" [B, C, D] f32 (per action dimension;
      a token VLA: per action token = per dimension), "values" [B] or [B, C] f32,
      "extras": {name: Tensor [B, ...]} (whatever evaluate needs to recompute the log-probs exactly, e.g. a flow
      model's denoising chain; stored in the trajectory, may be empty)}
  evaluate(obs, actions [N, C, D], extras) -> {"logprobs" [N, C, D], "entropy" [N, C, D], "values" [N] or [N, C]}
      (differentiable; with unchanged parameters the log-probs equal those of `act`: ratio = 1)
  values(obs) -> [B] or [B, C]
  needs_prompt: bool; tokenize(texts: list[str]) -> int64 [B, L] (VLAs)
  sft_loss(obs, actions [N, C, D]) -> scalar loss for behaviour cloning (VLAs: flow matching / token CE)
  save_pretrained(path) / from_pretrained(path) (VLAs: a local directory, never a hub download)
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
