"""The flow_vla family's rules (functions of the whole Config; raise ConfigError) and its value-dependent inert keys."""
from __future__ import annotations

from tasks.config.errors import ConfigError
from tasks.policies.vla_configuration import check_vla, inert_vla_keys

NOISE_METHODS = ("flow_sde", "flow_noise")


def check_noise(cfg) -> None:
    p = cfg.policy
    if p.noise_method not in NOISE_METHODS:
        raise ConfigError("policy.noise_method", p.noise_method, "use flow_sde or flow_noise")
    if not 0 < p.noise_std_min <= p.noise_std_max:
        raise ConfigError("policy.noise_std_min", p.noise_std_min,
                          f"need 0 < noise_std_min <= noise_std_max={p.noise_std_max}")
    if p.num_denoise_steps < 1:
        raise ConfigError("policy.num_denoise_steps", p.num_denoise_steps, "must be >= 1 (action_bins >= 2)")


def inert_keys(cfg, command: str, cuda_count: int = 0) -> list[tuple[str, str]]:
    """The VLA keys that do nothing here, and the noise keys of the noise method not chosen."""
    out = inert_vla_keys(cfg, command, normalizes_actions=True)
    if command != "run":
        return out
    if cfg.policy.noise_method == "flow_sde":
        why = ("bounds the learned std of policy.noise_method=flow_noise; flow_sde uses policy.noise_level: drop it "
               "or set policy.noise_method=flow_noise")
        return out + [("policy.noise_std_min", why), ("policy.noise_std_max", why)]
    return out + [("policy.noise_level", "is the noise scale of policy.noise_method=flow_sde; flow_noise learns its "
                                         "std (policy.noise_std_min/max): drop it or set policy.noise_method="
                                         "flow_sde")]


CHECKS = (check_vla, check_noise)
