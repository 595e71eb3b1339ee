"""The family registry: which config class a policy, env or cluster family has, selected by name.

A family is a folder (`tasks/policies/<name>/`, `tasks/envs/<name>/`, `pipelines/clusters/<kind>.py`) whose config
class is a dataclass subclassing its section's base (`tasks.config.schema.PolicyConfig` / `EnvConfig` /
`ClusterConfig`: the keys every family has) and adding only its own keys; it registers itself with
`@register_family(section, name, checks=...)`, where `checks` are the family's rules (plain functions of the whole
`Config` that raise `ConfigError`; `tasks.config.checks` runs them). The section's selector key (`SELECTORS`:
`policy.name`, `env.simulator`, `cluster.kind`) picks the family; a key the family's class lacks is an unknown key
for it (`pipelines.compose` refuses it, naming the family).

`MODULES` is the one table of the families' modules: `family_class` imports a family's module on its first lookup
(so the registry imports no family at import time, and adding a family is its folder, its conf file and one line
here). This module imports nothing of dagrl but `tasks.config.errors`.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Iterable

from tasks.config.errors import ConfigError, did_you_mean

# section -> the key that selects its family
SELECTORS: dict[str, str] = {"policy": "name", "env": "simulator", "cluster": "kind"}
# section -> what its families are called in messages ("known policies: [...]")
NOUNS: dict[str, str] = {"policy": "policies", "env": "simulators", "cluster": "cluster kinds"}
# section -> the family a config that selects none gets (the schema's default)
DEFAULTS: dict[str, str] = {"policy": "mlp", "env": "maniskill", "cluster": "local"}

# section -> family name -> the module that registers it (imported on the first lookup of that section)
MODULES: dict[str, dict[str, str]] = {
    "policy": {
        "mlp": "tasks.policies.mlp.configuration",
        "token_vla": "tasks.policies.token_vla.configuration",
        "pi0": "tasks.policies.pi0.configuration",
        "pi05": "tasks.policies.pi05.configuration",
    },
    "env": {
        "maniskill": "tasks.envs.maniskill.configuration",
        "libero": "tasks.envs.libero.configuration",
    },
    # the cluster kinds start processes, so they live in pipelines/clusters/ (one kind a file)
    "cluster": {
        "local": "pipelines.clusters.local",
        "address": "pipelines.clusters.address",
        "slurm": "pipelines.clusters.slurm",
        "pbs": "pipelines.clusters.pbs",
        "lsf": "pipelines.clusters.lsf",
        "sge": "pipelines.clusters.sge",
        "kubernetes": "pipelines.clusters.kubernetes",
    },
}

# section -> retired family name -> what replaces it: a config (a command line, an old run's config.yaml) naming one
# is refused in one line naming the replacement (`family_class`), not with the unknown-family list
RETIRED: dict[str, dict[str, str]] = {
    "policy": {
        "flow_vla": "pi0 (policy.name=pi0; the tiny preset: policy=pi0_tiny)",  # see RETIRED_OPTIONS for its conf files
    },
}

# config group -> option (a conf/GROUP/NAME.yaml removed with a retired family) -> the option that replaces it
RETIRED_OPTIONS: dict[str, dict[str, str]] = {
    "policy": {"flow_vla_tiny": "pi0_tiny", "flow_vla_tiny_critic": "pi0_tiny"},
    "conf": {"pushcube_flow_sft": "pushcube_pi0_sft", "pushcube_flow_grpo": "pushcube_pi0_grpo",
             "pushcube_flow_ppo": "pushcube_pi0_ppo", "libero_flow_sft": "libero_pi0_sft",
             "libero_flow_grpo": "libero_pi0_grpo"},
}


def retired_option(group: str, name: str) -> str | None:
    """The fix for choosing `group=name` when that option was retired (`RETIRED_OPTIONS`): one line naming the
    option that replaces it; None for any other option."""
    new = RETIRED_OPTIONS.get(group, {}).get(name)
    return None if new is None else f"conf/{group}/{name}.yaml was retired with its policy family: use {group}={new}"


_CLASSES: dict[str, dict[str, type]] = {s: {} for s in SELECTORS}
_CHECKS: dict[str, dict[str, tuple[Callable, ...]]] = {s: {} for s in SELECTORS}


def _section(section: str) -> None:
    if section not in SELECTORS:
        raise ValueError(f"unknown config section {section!r}: families exist for {list(SELECTORS)}")


def register_family(section: str, name: str, *, checks: Iterable[Callable] | None = None):
    """Class decorator: register `cls` as the config class of family `name` of `section` ("policy", "env",
    "cluster"), with its rules `checks` (functions `check(cfg: Config) -> None` raising ConfigError, run once per
    validation by `tasks.config.checks.check_config`, after the sections' own rules).

    The class must be a frozen dataclass (`@dataclass(frozen=True)`, as every config section: a built config is
    never changed in place, tasks.config.schema) whose selector field (`SELECTORS[section]`) defaults to `name`.

    Raises:
        ValueError: an unknown section, a class that is no dataclass, is not frozen or whose selector default is not
            `name`, or `name` registered already with another class.
    """
    _section(section)

    def wrap(cls: type) -> type:
        key = SELECTORS[section]
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"{section} family {name!r}: {cls.__name__} is not a dataclass")
        if not cls.__dataclass_params__.frozen:
            raise ValueError(f"{section} family {name!r}: {cls.__name__} must be @dataclass(frozen=True) (config "
                             f"sections are frozen)")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if key not in fields or fields[key].default != name:
            raise ValueError(f"{section} family {name!r}: {cls.__name__}.{key} must default to {name!r}")
        known = _CLASSES[section].get(name)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"{section} family {name!r} is registered already ({known.__module__}."
                             f"{known.__qualname__}); known: {sorted(_CLASSES[section])}")
        _CLASSES[section][name] = cls
        _CHECKS[section][name] = tuple(checks or ())
        return cls

    return wrap


def _load(section: str, name: str | None = None) -> None:
    """Import the module(s) of MODULES[section] (only `name`'s when given) not yet registered."""
    names = [name] if name is not None else list(MODULES[section])
    for n in names:
        if n in MODULES[section] and n not in _CLASSES[section]:
            importlib.import_module(MODULES[section][n])


def families(section: str) -> dict[str, type]:
    """The registered families of `section`: name -> config class (every family of MODULES imported first), in
    MODULES' order (then any family registered outside it), whatever order their modules were imported in: what is
    built from the families (the union Hydra composes against, the reference pages) does not depend on imports."""
    _section(section)
    _load(section)
    order = list(MODULES.get(section, {}))
    return dict(sorted(_CLASSES[section].items(),
                       key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def family_class(section: str, name: str) -> type:
    """The config class of family `name` of `section`.

    Raises:
        ConfigError: key `<section>.<selector>` (policy.name, env.simulator, cluster.kind): an unknown family,
            listing the known ones, with a did-you-mean; a retired family (`RETIRED`), naming its replacement.
    """
    _section(section)
    _load(section, name)
    cls = _CLASSES[section].get(name)
    if cls is None and name in RETIRED.get(section, {}):
        raise ConfigError(f"{section}.{SELECTORS[section]}", name,
                          f"the {name} family was retired: use {RETIRED[section][name]}")
    if cls is None:
        known = sorted(families(section))
        hint = did_you_mean(str(name), known)
        raise ConfigError(f"{section}.{SELECTORS[section]}", name,
                          f"known {NOUNS[section]}: {known}" + (f"; {hint}" if hint else ""))
    return cls


def family_checks(section: str, name: str) -> tuple[Callable, ...]:
    """The rules registered with family `name` of `section` (ConfigError for an unknown family, as family_class)."""
    family_class(section, name)
    return _CHECKS[section][name]


def default_class(section: str, base: type) -> type:
    """The class of the section's default family (DEFAULTS) when one is registered or listed in MODULES, else
    `base` (a section whose families are not written yet)."""
    _section(section)
    name = DEFAULTS[section]
    if name in _CLASSES[section] or name in MODULES[section]:
        return family_class(section, name)
    return base
