"""The config families at composition: Hydra composes against the union of every family's keys (so a group file or
override may name any family's key), then `typed_config` merges the composed values onto the classes the composed
selectors pick (`policy.name`, `env.simulator`, `cluster.kind`: tasks.config.registry), where a key the family lacks
is an unknown key, refused naming the family with a did-you-mean (`unknown_family_key`).

In the union schema a key that only some families have defaults to `???` (OmegaConf's MISSING): a composed value
still `???` there was set by nobody, and `set_values` drops it before the typed merge. A dict key (policy.sizes)
defaults to its family default instead (so `+policy.sizes.patch_size=4` can add an entry), and is dropped when it
still holds that default.
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from omegaconf import MISSING

from tasks.config import Config, ConfigError, close_matches, families, family_class
from tasks.config.registry import DEFAULTS, SELECTORS
from tasks.config.schema import ClusterConfig, EnvConfig, PolicyConfig

BASES: dict[str, type] = {"policy": PolicyConfig, "env": EnvConfig, "cluster": ClusterConfig}
_UNION: list[tuple] = []  # [(the registered families, the union Config)]
_DICT_DEFAULTS: dict[tuple[str, str], dict] = {}  # (section, key) -> a family dict key's default in the union


def _union_section(section: str) -> type:
    """A dataclass with the base's keys (their defaults) and every family's own keys (default `???`)."""
    base = BASES[section]
    own = {f.name for f in dataclasses.fields(base)}
    extra: dict[str, tuple] = {}
    for cls in families(section).values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in own and f.name not in extra:
                if typing.get_origin(hints[f.name]) is dict:  # a dict: `+section.key.entry=` must add into it
                    default = f.default_factory()
                    _DICT_DEFAULTS[section, f.name] = default
                    spec = dataclasses.field(default_factory=lambda d=default: dict(d))
                else:
                    spec = dataclasses.field(default=MISSING)
                extra[f.name] = (f.name, hints[f.name], spec)
    return dataclasses.make_dataclass(f"Any{base.__name__}", list(extra.values()), bases=(base,), frozen=True)


def union_schema() -> type:
    """`Config` whose family sections accept every family's keys: the node Hydra composes against (built again
    when a family is registered since)."""
    key = tuple((s, tuple(families(s).items())) for s in SELECTORS)
    if not _UNION or _UNION[0][0] != key:
        fields = [(s, _union_section(s)) for s in SELECTORS]
        _UNION[:] = [(key, dataclasses.make_dataclass(
            "AnyConfig", [(s, cls, dataclasses.field(default_factory=cls)) for s, cls in fields], bases=(Config,),
            frozen=True))]
    return _UNION[0][1]


def schema_node(obj):
    """`OmegaConf.structured(obj)` (a config dataclass or instance) that Hydra and `OmegaConf.merge` can write onto:
    OmegaConf marks the node of every frozen dataclass read-only, and the schema's sections are frozen
    (tasks.config.schema), so those flags are cleared here (each node's own; they are then inherited: writable).
    The types and the closed key sets of the schema stay. Returns a DictConfig."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    def clear(node) -> None:
        node._set_flag("readonly", None)
        if node._is_none() or node._is_missing():
            return
        for k in (node if isinstance(node, DictConfig) else range(len(node))):
            child = node._get_node(k)
            if isinstance(child, (DictConfig, ListConfig)):
                clear(child)
    root = OmegaConf.structured(obj)
    clear(root)
    return root


def set_values(plain: dict) -> dict:
    """`plain` (a composed config as a container) without the family keys nobody set (still `???`)."""
    out = dict(plain)
    for section in SELECTORS:
        if isinstance(out.get(section), dict):
            base = {f.name for f in dataclasses.fields(BASES[section])}
            out[section] = {k: v for k, v in out[section].items()
                            if k in base or (v != MISSING and _DICT_DEFAULTS.get((section, k), MISSING) != v)}
    return out


def selected(plain: dict) -> dict[str, type]:
    """section -> the family class `plain`'s selectors pick (the default family where none is given).
    Raises ConfigError: an unknown family (the selector key, the known names, did-you-mean)."""
    out = {}
    for section, key in SELECTORS.items():
        name = (plain.get(section) or {}).get(key, DEFAULTS[section])
        out[section] = family_class(section, name)
    return out


def typed_config(classes: dict[str, type], plain: dict) -> Config:
    """`OmegaConf.to_object(OmegaConf.merge(schema_node(config), plain))` where `config` is a default `Config` whose
    family sections are of the classes `classes` gives (section -> class), computed section by section: each
    section of `plain` is merged onto the node of its class (the family class `classes` names, else the `Config`
    field's), the top-level values onto a node of `Config`'s scalar fields, and `Config` is built from the parts.
    The same checks (a key the class lacks, a value of the wrong type) and the same values as one merge of the whole
    config: no section's keys or values depend on another's (`plain` is resolved). A section's result is kept by
    (name, class, values) (pipelines.compose_memo) and handed out as a copy: the unit tier types thousands of
    configs that differ in one section or two.

    Raises OmegaConf's exceptions, `full_key` the dotted key from the config's root."""
    import copy

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from pipelines import compose_memo as memo
    if any(name in _SECTION_TYPES and not isinstance(value, dict) for name, value in plain.items()):
        whole = schema_node(Config(**{section: cls() for section, cls in classes.items()}))  # a section set to a
        return OmegaConf.to_object(OmegaConf.merge(whole, plain))  # scalar: OmegaConf's own error for it
    sections, top = {}, {}
    for name, value in plain.items():
        cls = classes.get(name) or _SECTION_TYPES.get(name)
        if cls is None:
            top[name] = value
            continue
        try:
            key = (name, cls, repr(value))  # plain values: str, int, float, bool, None, lists, dicts
            sections[name] = copy.deepcopy(memo.once(
                "typed_section", key, lambda: OmegaConf.to_object(OmegaConf.merge(_section_node(cls), value))))
        except OmegaConfBaseException as exc:
            exc.full_key = f"{name}.{exc.full_key}" if getattr(exc, "full_key", None) else name
            raise
    scalars = OmegaConf.to_container(OmegaConf.merge(_section_node(_TOP), top))
    return Config(**scalars, **sections)


_HINTS = typing.get_type_hints(Config)
_SECTION_TYPES: dict[str, type] = {f.name: _HINTS[f.name] for f in dataclasses.fields(Config)
                                   if dataclasses.is_dataclass(_HINTS[f.name])}
# Config's top-level values (experiment, seed, run_root), named Config so OmegaConf's messages read as for the whole
_TOP = dataclasses.make_dataclass("Config", [(f.name, _HINTS[f.name], dataclasses.field(default=f.default))
                                             for f in dataclasses.fields(Config) if f.name not in _SECTION_TYPES])


def _section_node(cls: type):
    """`schema_node(cls())`, built once per class (only read: `OmegaConf.merge` copies the node it writes onto)."""
    from pipelines import compose_memo as memo
    return memo.once("section_node", cls, lambda: schema_node(cls()))


def unknown_family_key(key: str, value, classes: dict[str, type]) -> ConfigError | None:
    """The error for `key`, a key of a family section the selected family lacks: the family named, the family
    keys it may have meant, and the families that have it. None when `key` is not in a family section."""
    section, _, rest = key.partition(".")
    if section not in SELECTORS or not rest or "." in rest:
        return None
    cls, selector = classes[section], SELECTORS[section]
    name = next(f.default for f in dataclasses.fields(cls) if f.name == selector)  # its selector's default
    known = [f.name for f in dataclasses.fields(cls)]
    have = sorted(n for n, c in families(section).items() if rest in {f.name for f in dataclasses.fields(c)})
    fix = f"unknown key for {section}.{selector}={name} (the {name} family has no {rest!r})"
    close = close_matches(rest, known)
    if close:
        fix += f"; did you mean {' or '.join(f'{section}.{c}' for c in close)}?"
    if have:
        presets = [f for n in have for f in family_presets(section, n)]
        fix += f"; it is a key of {section}.{selector}={'|'.join(have)}" + (
            f": choose a preset of that family ({', '.join(f'{section}={f}' for f in presets[:4])})" if presets
            else f": set {section}.{selector}={have[0]}" if len(have) == 1 else "")
    return ConfigError(key, value, fix)


def family_presets(section: str, name: str) -> list[str]:
    """The group files of conf/<section>/ that select family `name` (their `<section>.<selector>`, directly or through
    a group file they extend), sorted: what a user picks (`policy=mlp`) rather than setting the selector alone,
    which would keep the other family's keys of the experiment."""
    import yaml
    selector, found = SELECTORS[section], {}

    def chosen(path: Path) -> str | None:
        if path.name in found:
            return found[path.name]
        found[path.name] = None  # a cycle of defaults chooses nothing
        text = path.read_text()
        data = yaml.safe_load(text) or {}
        own = data.get(section) if text.lstrip().startswith("# @package _global_") else data
        value = own.get(selector) if isinstance(own, dict) else None
        for parent in data.get("defaults", []) if value is None else []:
            if isinstance(parent, str) and (path.parent / f"{parent}.yaml").is_file():
                value = chosen(path.parent / f"{parent}.yaml")
                if value is not None:
                    break
        if value is None and isinstance(own, dict) and own:  # sets the section's keys, not its selector
            value = DEFAULTS[section]
        found[path.name] = value
        return value
    return sorted(p.stem for p in (CONF_DIR / section).glob("*.yaml") if chosen(p) == name)


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the project's Hydra tree (pipelines.compose composes it)


def family_defaults() -> list[Config]:
    """`Config()`, then a default Config for each family of each section (where a family key's default lives)."""
    out = [Config()]
    for section in SELECTORS:
        out.extend(Config(**{section: cls()}) for cls in families(section).values())
    return out


def drop_other_family_keys(dcfg, given: dict[str, str], from_command_line, notes: list[str] | None = None):
    """`dcfg` (a composed config) without the keys a file set for another family than the one the command line
    selects: where a section's selector (`cluster.kind`, `policy.name`, `env.simulator`) is set on the command line
    (or by a group file chosen there), a key of that section that a group or experiment FILE set (`given`: key ->
    where, pipelines.config.given_keys; `from_command_line(where)`) and the selected family lacks while another
    family has it is reset to unset (`???`, dropped by `set_values`), with one note each: the experiment's settings
    for the family it chose (e.g. conf=smoke's `cluster.dashboard_address` with `cluster=address`). A key given on
    the command line is kept, and refused as unknown for the family by `to_config`. `notes` as
    pipelines.config.check_given (None: printed to stderr). Returns `dcfg` (changed in place)."""
    import sys

    from omegaconf import OmegaConf
    for section, selector in SELECTORS.items():
        if not from_command_line(given.get(f"{section}.{selector}", "")):
            continue
        name = OmegaConf.select(dcfg, f"{section}.{selector}")
        cls = family_class(section, name)
        have = {f.name for f in dataclasses.fields(cls)}
        others = {n: {f.name for f in dataclasses.fields(c)} for n, c in families(section).items() if n != name}
        for key, where in given.items():
            sec, _, rest = key.partition(".")
            top = rest.split(".", 1)[0]
            if sec != section or not rest or top in have or from_command_line(where):
                continue
            owners = sorted(n for n, keys in others.items() if top in keys)
            if not owners:
                continue
            value = OmegaConf.select(dcfg, f"{section}.{top}")
            OmegaConf.update(dcfg, f"{section}.{top}", MISSING, merge=False)
            line = (f"note: {section}.{top}={value!r} (set in {where}) does nothing with the command line's "
                    f"{section}.{selector}={name}: it is a key of {section}.{selector}={'|'.join(owners)}")
            if notes is None:
                print(line, file=sys.stderr)
            else:
                notes.append(line)
    return dcfg


def other_family_keys(plain: dict) -> list[str]:
    """The dotted keys of `plain` (a saved config as a plain nested dict) in a family section that its selected
    family lacks: a run config written when every section held every family's keys holds them (they did nothing
    there); `python -m pipelines.upgrade` drops them. Raises ConfigError for an unknown family."""
    classes = selected(plain)
    return [f"{s}.{k}" for s, cls in classes.items() if isinstance(plain.get(s), dict)
            for k in plain[s] if k not in {f.name for f in dataclasses.fields(cls)}]
