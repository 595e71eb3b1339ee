"""The rules of the pi0 / pi05 families (functions of the whole Config; raise ConfigError) and their
value-dependent inert keys."""
from __future__ import annotations

from tasks.config.errors import ConfigError
from tasks.policies.pi0.memory import check_memory_plan, check_training_keys

PRESETS = ("tiny", "base")
NOISE_METHODS = ("flow_sde", "flow_noise")
VALUE_HEADS = ("mean_token", "first_token", "last_token")


def check_pi0(cfg) -> None:
    """Preset, sampler and prompt keys of policy=pi0 / pi05. Raises ConfigError (policy.*)."""
    p = cfg.policy
    if cfg.env.obs_mode != "rgb":
        raise ConfigError("env.obs_mode", cfg.env.obs_mode, f"policy.name={p.name} reads camera images: use "
                                                             f"env.obs_mode=rgb (e.g. env=pushcube_vla)")
    if p.preset not in PRESETS:
        raise ConfigError("policy.preset", p.preset, f"use one of {list(PRESETS)} (or policy.model_path=DIR)")
    if p.noise_method not in NOISE_METHODS:
        raise ConfigError("policy.noise_method", p.noise_method, "use flow_sde or flow_noise")
    if p.num_denoise_steps < 1:
        raise ConfigError("policy.num_denoise_steps", p.num_denoise_steps, "use >= 1 (pi0 infers with 10)")
    if p.noise_method == "flow_sde" and not p.noise_level >= 0:
        raise ConfigError("policy.noise_level", p.noise_level, "use >= 0 (piRL uses 0.5; 0 is the ODE)")
    if p.noise_method == "flow_noise" and not 0 < p.noise_std_min <= p.noise_std_max:
        raise ConfigError("policy.noise_std_min", (p.noise_std_min, p.noise_std_max),
                          "need 0 < noise_std_min <= noise_std_max (piRL uses 0.08, 0.16)")
    if p.max_prompt_len < 2:
        raise ConfigError("policy.max_prompt_len", p.max_prompt_len, "use >= 2 (BOS and the task's text)")
    if p.value_head not in VALUE_HEADS:
        raise ConfigError("policy.value_head", p.value_head, f"use one of {list(VALUE_HEADS)}")


def inert_keys(cfg, command: str, cuda_count: int = 0) -> list[tuple[str, str]]:
    """The keys of policy=pi0 / pi05 that do nothing for `cfg` under `command`: the noise keys of the noise method
    not chosen, the value head's keys without a critic."""
    if command != "run":
        return []
    p, a = cfg.policy, cfg.algorithm
    # policy.preset with a model_path is not flagged: the directory's config.json decides the architecture, and the
    # presets (pi0_base, pi0_tiny) are how a user picks the family's settings for a checkpoint too
    out = []
    if p.noise_method == "flow_sde":
        why = ("bounds the learned std of policy.noise_method=flow_noise; flow_sde uses policy.noise_level: drop it "
               "or set policy.noise_method=flow_noise")
        out += [("policy.noise_std_min", why), ("policy.noise_std_max", why)]
    else:
        out.append(("policy.noise_level", "is the noise scale of policy.noise_method=flow_sde; flow_noise learns "
                                          "its std (policy.noise_std_min/max): drop it or set "
                                          "policy.noise_method=flow_sde"))
    critic = a.spec.critic if a.spec.estimator else cfg.sft.value_coef > 0
    if not critic:
        why = f"shapes the value head, which algorithm.name={a.name} does not train: drop it"
        out += [(k, why) for k in ("policy.value_head", "policy.value_detach")]
    if not p.lora_rank:
        why = "shapes the LoRA adapters, which policy.lora_rank=0 (full fine-tuning) does not make: drop it"
        out += [(k, why) for k in ("policy.lora_alpha", "policy.lora_targets")]
    return out


CHECKS = (check_pi0, check_training_keys, check_memory_plan)
