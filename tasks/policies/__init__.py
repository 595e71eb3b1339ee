"""Policy families behind one registry with a uniform constructor (the Policy protocol).

Observations are a dict of batched tensors (every key optional except "state"):
  "state"  float32 [B, O]        the env's flat state vector
  "rgb"    uint8   [B, H, W, 3]  one camera image (env.obs_mode=rgb), H = W = env.image_size
  "wrist_rgb" uint8 [B, H, W, 3] the second camera (LIBERO's env.wrist_camera; families whose config has
                                 `cameras` = 2 read it: pi0, pi05; tasks.prompts.policy_obs splits the env's images)
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

from tasks.config import ConfigError, PolicyConfig, family_class

def policy_class(name: str) -> type:
    """The nn.Module of policy family `name`: its config class's `model` ("module:Class", tasks/policies/<name>/
    configuration.py). Raises ConfigError (policy.name) for an unknown family, listing the known ones."""
    module, cls = family_class("policy", name).model.split(":")
    return getattr(importlib.import_module(module), cls)


def make_policy(cfg: PolicyConfig, *, obs_dim: int, action_dim: int, num_values: int = 1,
                seed: int | None = None, image_size: int | None = None, load: bool = True) -> torch.nn.Module:
    """Build a policy by `cfg.name`; `seed` makes the initial parameters reproducible.

    Args:
        image_size: camera size (pixels) for policies with image input; None for state-only observations.
        load: with `cfg.model_path` set, load the weights saved there (`from_pretrained`); replicas that receive
            their weights from the actor pass False.

    Raises:
        ConfigError: unknown policy name (lists the known ones); a `model_path` that is not a checkpoint of this
            policy family or whose action dim / value outputs / image size do not fit the env task.
    """
    cls = policy_class(cfg.name)
    kwargs = {"image_size": image_size} if type(cfg).images else {}  # a family that reads camera images
    with torch.random.fork_rng():
        if seed is not None:
            torch.manual_seed(seed)
        policy = cls(cfg, obs_dim, action_dim, num_values, **kwargs)
    if load and cfg.model_path:
        load_pretrained(policy, cfg.model_path)
    return policy


def load_pretrained(policy: torch.nn.Module, path: str) -> None:
    """Load the weights saved by `save_pretrained` at `path` into `policy` (same family and sizes).

    Raises:
        ConfigError (key policy.model_path): missing directory, another family, or tensors of other shapes.
    """
    import os
    if not os.path.isdir(path):
        raise ConfigError("policy.model_path", path, "no such directory; point it at a save_pretrained checkpoint")
    try:
        loaded = type(policy).from_pretrained(path)
    except Exception as exc:  # noqa: BLE001  (any failure to read is a bad checkpoint path)
        raise ConfigError("policy.model_path", path,
                          f"not a {type(policy).__name__} checkpoint ({type(exc).__name__}: {exc})") from None
    own, new = policy.state_dict(), loaded.state_dict()
    bad = [k for k in own if k in new and own[k].shape != new[k].shape]
    missing = [k for k in own if k not in new]
    # heads that only RL adds (a value head of another size, a Flow-Noise std head) keep their fresh initialisation
    fresh_ok = ("value_head.", "noise_head.")
    if any(not k.startswith(fresh_ok) for k in missing):
        raise ConfigError("policy.model_path", path, f"checkpoint lacks tensors {missing[:3]}")
    bad = [k for k in bad if not k.startswith(fresh_ok)]
    if bad:
        raise ConfigError("policy.model_path", path,
                          f"tensor shapes differ from this config's policy ({bad[:3]} ...): the checkpoint was made "
                          f"with other sizes, action dim or chunk length")
    policy.load_state_dict({**own, **{k: v for k, v in new.items() if k in own and own[k].shape == v.shape}})
    for attr in ("action_stats",):
        if hasattr(loaded, attr) and hasattr(policy, attr):
            setattr(policy, attr, getattr(loaded, attr))


def check_policy_config(cfg: PolicyConfig) -> dict | None:
    """Offline checks of a policy config that need the family's model module (its `check_config(cfg)`, if it has
    one: a VLA's preset and sizes); returns what that returns (a VLA's resolved sizes), else None. The family's
    plain rules run with the config's (tasks/policies/<name>/checks.py). Raises ConfigError."""
    check = getattr(importlib.import_module(family_class("policy", cfg.name).model.split(":")[0]), "check_config", None)
    return check(cfg) if check is not None else None
