"""A run's saved resolved config (`<run dir>/config.yaml`): its verified read, the older formats it is refused for
(with the upgrade that converts it) and its load as `Config` through the same typed schema as a composition
(`pipelines.compose.to_config`)."""
from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from tasks.config import Config, ConfigError

from pipelines.compose import to_config


def load_saved_config(path, *, validate: bool = True) -> Config:
    """A run's saved resolved config (`<run dir>/config.yaml`) as `Config`: the schema (unknown keys and wrong types
    refused; one of an older format (`old_config_keys`) refused in one line naming the file and
    `python -m pipelines.upgrade RUN_DIR`) and, unless `validate=False`,
    `tasks.config.check_config`. The one loader of saved configs (pipelines.record's teacher, pipelines.replay's env); a
    composition from conf/ goes through `load_config`.

    Raises:
        ConfigError: as `to_config`; the file damaged (`storage.rundir.read_resolved_config`: empty, or its sha256
            differs from the digest beside it). FileNotFoundError: no file at `path`. yaml.YAMLError: not YAML.
    """
    return to_config(read_saved_config(path), validate=validate, saved=True)


def old_config_keys(container: dict) -> list[str]:
    """The keys of an older config format a saved config (plain nested dict) holds: algorithm.adv_type, and the
    keys of a family section its family lacks (a config written when every section held every family's keys;
    `pipelines.families.other_family_keys`). `python -m pipelines.upgrade` drops them."""
    from pipelines.families import other_family_keys
    algo = container.get("algorithm")
    out = ["algorithm.adv_type"] if isinstance(algo, dict) and "adv_type" in algo else []
    try:
        return out + other_family_keys(container)
    except ConfigError:  # an unknown family: the typed merge names it
        return out


def refusal(path: str | os.PathLike, what: str) -> str:
    """The one line a reader of an older run file prints: the file, what is old, the fix."""
    run_dir = Path(path).parent
    if run_dir.parent.name == "checkpoints":
        run_dir = run_dir.parent.parent
    return f"{path} is of an older format ({what}): rewrite its run once with `python -m pipelines.upgrade {run_dir}`"


def read_saved_config(path) -> DictConfig:
    """A run's saved `config.yaml` as OmegaConf, verified (`storage.rundir.read_resolved_config`): the one read of
    saved configs (load_saved_config, pipelines.eval's source config, the provenance of a checkpoint).

    Raises:
        ConfigError: the file is damaged, or of an older format (`old_config_keys`: the key it holds), one line
            naming it and the fix. FileNotFoundError, yaml.YAMLError.
    """
    from storage.rundir import DamagedRunFile, read_resolved_config
    try:
        text = read_resolved_config(path)
    except DamagedRunFile as exc:
        raise ConfigError("config.yaml", str(path), str(exc)) from None
    dcfg = OmegaConf.create(text)
    old = old_config_keys(OmegaConf.to_container(dcfg))
    if old:
        raise ConfigError(old[0], OmegaConf.select(dcfg, old[0]), refusal(path, f"it has {old[0]}"))
    return dcfg
