"""The token_vla family's rules (functions of the whole Config; raise ConfigError) and its value-dependent inert keys."""
from __future__ import annotations

from tasks.config.errors import ConfigError
from tasks.policies.vla_configuration import check_vla, inert_vla_keys


def check_tokens(cfg) -> None:
    p = cfg.policy
    if not p.temperature > 0:
        raise ConfigError("policy.temperature", p.temperature, "use > 0 (1.0: the plain softmax)")
    if p.action_bins < 2:
        raise ConfigError("policy.action_bins", p.action_bins, "must be >= 1 (action_bins >= 2)")


def inert_keys(cfg, command: str, cuda_count: int = 0) -> list[tuple[str, str]]:
    """The VLA keys that do nothing here (a token VLA un-normalises its actions by its own q01/q99 statistics)."""
    return inert_vla_keys(cfg, command, normalizes_actions=False)


CHECKS = (check_vla, check_tokens)
