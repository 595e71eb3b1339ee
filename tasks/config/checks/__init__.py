"""Every rule of the config, as functions that import the schema (never the reverse). `check_config` runs them all
once: the top-level keys, each section's own rules (`sections`), the rules across sections (`across`), then the
rules each selected family registered with it (`tasks.config.registry.register_family(..., checks=...)`).
What needs the simulator, the devices or files on disk beyond a path's existence is checked by
`pipelines.compose` (components, placement); keys set but doing nothing: `inert`.
"""
from __future__ import annotations

from tasks.config.checks.across import (check_across, check_async, check_device, check_whole_episodes,  # noqa: F401
                                        cuda_available)
from tasks.config.checks.inert import COMMANDS, config_value, inert_keys, inert_reason  # noqa: F401
from tasks.config.checks.sections import (check_algorithm, check_env, check_eval, check_policy,  # noqa: F401
                                          check_rollout, check_runner, check_seed, positive)
from tasks.config.errors import ConfigError
from tasks.config.registry import SELECTORS, family_checks
from tasks.config.schema import Config


def check_family(cfg: Config, section: str) -> None:
    """The rules registered with the selected family of `section` ("policy", "env", "cluster"), in order.
    Raises ConfigError (an unknown family: the selector key, with the known names)."""
    name = getattr(getattr(cfg, section), SELECTORS[section])
    for check in family_checks(section, name):
        check(cfg)


def check_config(cfg: Config) -> Config:
    """Check every value and combination that cannot work; raise ConfigError (one line: key, value, fix) on the
    first. Returns `cfg`. The one place every rule runs from (pipelines.compose.load_config calls it once)."""
    if cfg.experiment in (".", ".."):
        raise ConfigError("experiment", cfg.experiment, "use a plain name (it becomes a directory)")
    if "/" in cfg.experiment or not cfg.experiment:
        raise ConfigError("experiment", cfg.experiment, "use a non-empty name without '/'")
    check_seed("seed", cfg.seed)
    if not cfg.tracking.wait_s >= 0:
        raise ConfigError("tracking.wait_s", cfg.tracking.wait_s, "must be >= 0 (seconds the pre-flight waits for "
                          "an http(s) tracking server to answer; 0: one try)")
    check_env(cfg.env)
    check_family(cfg, "env")
    check_policy(cfg.policy)
    check_family(cfg, "policy")
    check_algorithm(cfg.algorithm)
    check_rollout(cfg.rollout)
    check_runner(cfg.runner)
    check_family(cfg, "cluster")  # the cluster's rules are its kinds' (pipelines/clusters/checks.py)
    check_across(cfg)
    return cfg
