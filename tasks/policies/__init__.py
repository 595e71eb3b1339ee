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
  save_pretrained(path) / from_pretrained(path) (every family: a local directory, never a hub download; the
      `hf/` export of every checkpoint, the directory `policy.model_path` takes)
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


def module_prefixes(names) -> list[str]:
    """Every prefix at a dot boundary of the parameter `names` (their modules and the names themselves), in order of
    first appearance: what an `algorithm.lr_scale` or `policy.freeze` prefix may be (the did-you-mean's choices)."""
    out: dict[str, None] = {}
    for n in names:
        parts = n.split(".")
        for i in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:i]))
    return list(out)


def prefix_hint(prefix: str, names) -> str:
    """The did-you-mean of a parameter-name `prefix` that matches none of `names`: the modules (or names) at its
    depth it is close to (tasks.config.did_you_mean), else "" ."""
    from tasks.config import did_you_mean
    depth = prefix.count(".")
    return did_you_mean(prefix, [m for m in module_prefixes(names) if m.count(".") == depth])


def parameter_names(cfg) -> list[str] | None:
    """The `named_parameters()` names of the policy the whole Config `cfg` builds, offline (no weights read): the
    family's own answer where its model class has one (`offline_parameter_names(cfg)`: pi0 / pi05 build the
    library's model on the meta device), else the policy built on the meta device with the env's state and action
    lengths (placeholders where they are known only once an env is built: the names do not depend on them). None when
    the policy cannot be built offline (a ConfigError of its own keys, raised by the checks that own them)."""
    from tasks.envs import action_dim, state_dim
    cls = policy_class(cfg.policy.name)
    own = getattr(cls, "offline_parameter_names", None)
    try:
        if own is not None:
            return list(own(cfg))
        num_values = cfg.policy.num_action_chunks if cfg.algorithm.spec.critic else 1
        kwargs = {"image_size": cfg.env.image_size if cfg.env.obs_mode == "rgb" else None} \
            if type(cfg.policy).images else {}
        args = (cfg.policy, state_dim(cfg.env) or 8, action_dim(cfg.env) or 8, num_values)
        try:
            with torch.device("meta"):
                policy = cls(*args, **kwargs)
        except (NotImplementedError, RuntimeError):  # an initialiser without a meta kernel: built on the CPU
            policy = cls(*args, **kwargs)
        return [n for n, _ in policy.named_parameters()]
    except (ConfigError, OSError, ValueError):
        return None


def check_lr_scale(cfg) -> None:
    """Every `algorithm.lr_scale` prefix names parameters of the policy (`parameter_names`; at a dot boundary, as
    tasks.actor.optim.make_optimizer matches them when the actor starts, after the cluster has).

    Raises:
        ConfigError (algorithm.lr_scale.PREFIX): a prefix under which the policy has no parameter, with close
            matches and the policy's top modules.
    """
    scale = cfg.algorithm.lr_scale
    names = parameter_names(cfg) if scale else None
    if not names:
        return
    for key, value in scale.items():
        if any(n == key or n.startswith(key + ".") for n in names):
            continue
        hint = prefix_hint(key, names)
        top = sorted({".".join(n.split(".")[:2 if n.count(".") > 1 else 1]) for n in names})  # modules, not leaves
        raise ConfigError(f"algorithm.lr_scale.{key}", value,
                          f"no parameter of the policy.name={cfg.policy.name} policy is under {key!r} (prefixes at a "
                          f"dot boundary); " + (f"{hint} " if hint else "") + f"its modules: {', '.join(top)}")


def check_components(cfg) -> None:
    """The policy's checks of a whole Config that need its components (run by pipelines.components wherever the
    components are checked: run, validate, eval, record): the family's `component_checks` (its config class:
    pi0 / pi05's prompt length against the env's instructions and the checkpoint's tokenizer), then
    `check_lr_scale`. Raises ConfigError."""
    for check in type(cfg.policy).component_checks:
        check(cfg)
    check_lr_scale(cfg)
