"""Composition in two stages, each Hydra's own: the config groups' choices (`conf=`, `policy=`, ...: Hydra's defaults
list, ~0.1 s of CPU a composition) composed once per set of choices and kept (pipelines.compose_memo); the value
overrides (`a.b=1`, `+a.c=2`, `++a.d=3`, `~a.e`) then applied to a copy of it by Hydra's own
`ConfigLoaderImpl._apply_overrides_to_config` (~ms).

Hydra composes the same way inside one call (hydra/_internal/config_loader_impl.py, `_load_configuration_impl`): the
defaults list is built from the group overrides alone, the config is composed from it and set to struct mode, and the
value overrides (`Overrides.config_overrides`: an override whose key is not a config group, or whose value is a dict)
are applied last, in their order. So the result is the same DictConfig, and an error the same exception
(tests/pipelines/test_compose_values.py compares both paths, results and errors). The unit tier composes a few
thousand override lists that differ in values only; this keeps each to a copy and an update.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig


def _is_group(override, conf_dir: Path) -> bool:
    """What Hydra's `Overrides` treats as a group override (its `repo.group_exists(key)` and not a dict value), for
    this conf tree: a directory of conf/ (`conf`, `policy`, ...), and — left to Hydra's first stage, whatever it makes
    of them — anything with a package (`@`), a nested group path (`/`) or a `hydra` key."""
    key = override.key_or_group
    if override.package is not None or "/" in key or key == "hydra" or key.startswith("hydra."):
        return True
    if isinstance(override.value(), dict):
        return False
    return "." not in key and (conf_dir / key).is_dir()


def split(typed: Sequence[str], conf_dir: Path) -> tuple[list[str], list]:
    """`typed` (Hydra's override grammar, `pipelines.overrides.as_typed`) -> (the group overrides as given, the
    value overrides parsed by Hydra's parser, in their order). Raises Hydra's OverrideParseException as Hydra would."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parsed = OverridesParser.create().parse_overrides(list(typed))
    groups = [line for line, o in zip(typed, parsed) if _is_group(o, conf_dir)]
    values = [o for o in parsed if not _is_group(o, conf_dir)]
    return groups, values


def apply(dcfg: DictConfig, values: list) -> DictConfig:
    """Apply parsed value overrides to `dcfg` (in place; struct mode as Hydra leaves it) with Hydra's own function.
    Raises hydra.errors.ConfigCompositionException as Hydra's composition does."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    ConfigLoaderImpl._apply_overrides_to_config(values, dcfg)
    return dcfg
