"""Command-line overrides as Hydra must be given them: the grammar (`parse_overrides`), string keys kept as typed
(`as_typed`), and the one-line fixes for what Hydra cannot parse (a comma in a value, a dict key with commas).
Used by `pipelines.compose`; the schema it reads is the union of every family's keys (pipelines.families)."""
from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from tasks.config import ConfigError

# config groups: conf/GROUP/NAME.yaml, package GROUP (or `_global_` by the file's header: `_package`)
GROUPS = ("env", "policy", "algorithm", "rollout", "runner", "sft", "cluster")


# How values with commas, lists and dicts are written on the command line (Hydra's override grammar; tested in
# tests/pipelines/test_config.py). An unquoted comma makes a sweep (several runs), which dagrl refuses outside
# `pipelines.run -m` (pipelines.sweep).
QUOTING = ("a value with commas is a quoted string: key='\"0,1\"' (the shell passes key=\"0,1\" to Hydra), "
           "a list is [a,b], a dict is {k: v} with commas inside its keys escaped ({actor\\,env: all}), and a "
           "new dict key needs a leading + (+policy.sizes.patch_size=4)")


SWEEP_HINT = "for one run per value, a sweep: python -m pipelines.run -m KEY=A,B"


def parse_overrides(overrides: Sequence[str]) -> list:
    """Parse each override with Hydra's grammar. Returns Hydra `Override` objects, the value of a string key as
    typed (`as_typed`: `experiment=2026_12` is the string "2026_12"; `input_line` holds the override Hydra is given).

    Raises:
        ConfigError: naming the override's key: a value with an unquoted comma (a Hydra sweep; the fix quotes it as
            the key's type needs), an override the grammar cannot read (with the forms that work), or a value of a
            string key that cannot be kept as typed (`as_typed`).
    """
    from pipelines import compose_memo
    from pipelines.families import union_schema  # a string key's type can change when a family registers
    return list(compose_memo.once("parsed", (union_schema(), tuple(overrides)), lambda: tuple(_parse(overrides))))


def _parse(overrides: Sequence[str]) -> list:
    """`parse_overrides` without the memo (a composition parses its overrides about ten times)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    parser = OverridesParser.create()
    out = []
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        try:
            ov = parser.parse_override(o)
        except HydraException:
            raise _grammar_error(key, value) from None
        if ov.is_sweep_override():  # a sweep only under `pipelines.run -m` (pipelines.sweep expands it first)
            raise ConfigError(key, value, f"{_comma_fix(key, value)}; {SWEEP_HINT}")
        typed = _as_typed(o, ov)
        out.append(ov if typed == o else parser.parse_override(typed))
    return out


def as_typed(overrides: Sequence[str]) -> list[str]:
    """The overrides as Hydra must be given them so that every string key keeps the text the user typed.

    Hydra's grammar reads an unquoted value by its look: `2026_12` is the integer 202612 (underscores in numbers),
    `1e3` the float 1000.0, `true` the bool True, `inf`/`nan` floats, `+5` the integer 5. For a key the schema types
    as a string (`experiment`, `run_root`, `runner.resume`, `tracking.experiment`, `sft.store`, any `str` field, an
    entry of a `dict[str, str]` such as `cluster.component_placement`) and for a config group choice (`conf=`,
    `env=`, ...), the structured config would then hold `str(value)`: "202612", "1000.0", "True" - a run directory
    and an MLflow experiment the user did not name, silently. Such a value is given to Hydra quoted (`key='2026_12'`),
    so the key holds exactly what was typed. Number and bool keys are left as Hydra reads them (`runner.max_steps=
    1_000` is 1000: what was meant); `null` stays None for an Optional string key (`policy.model_path=null`).

    Raises:
        ConfigError: as `parse_overrides`; `null` for a string key that cannot be None (the fix: give a value, or
            quote the text null); inside a dict value, an entry of a string key that Hydra reads as a bool or a
            number written otherwise than Python prints it (the fix: quote that entry).
    """
    return [ov.input_line for ov in parse_overrides(overrides)]


_SCHEMA_NODE: list[tuple] = []  # [(the union schema, its OmegaConf node)], built once per schema


def _slot(key: str, family_keys: bool = False):
    """The schema's node at dotted `key` (the union schema's OmegaConf node, built once per schema); "new" for a new
    entry of a dict[str, str]; None for an unknown key or one below a value. A key only some families have holds
    `???` in the union schema: its node with `family_keys`, else None."""
    from pipelines.families import union_schema
    schema = union_schema()
    if not _SCHEMA_NODE or _SCHEMA_NODE[0][0] is not schema:
        _SCHEMA_NODE[:] = [(schema, OmegaConf.structured(schema))]
    node = _SCHEMA_NODE[0][1]
    for part in key.split("."):
        if not isinstance(node, DictConfig) or node._is_none() or node._is_missing():
            return None
        if part in node or (family_keys and part in node.keys()):  # `in` is False for a `???` value, keys() not
            node = node._get_node(part)
        elif node._metadata.element_type is str and part == key.rsplit(".", 1)[-1]:
            return "new"  # a new entry of a dict[str, str]
        else:
            return None
    return node


def _str_slot(key: str) -> bool | None:
    """Whether the schema holds a string at dotted `key`: None when it does not (another type, a section, an unknown
    key), else whether None is allowed there (Optional[str]). An entry of a dict section (a new one included) is a
    string when the dict's values are (`dict[str, str]`)."""
    from omegaconf.nodes import StringNode
    node = _slot(key)
    if isinstance(node, str):
        return False
    return node._is_optional() if isinstance(node, StringNode) else None


def _list_fix(key: str, value, raw: str) -> ConfigError | None:
    """A scalar (or null) given for a list key of the schema (`policy.freeze=hf.model.vlm`): the error naming the
    key and the bracketed form, instead of OmegaConf's type message; None for any other key or value."""
    from omegaconf import ListConfig
    node = _slot(key, family_keys=True)
    if not isinstance(node, ListConfig) or isinstance(value, (list, dict)) or (value is None and node._is_optional()):
        return None
    if value is None:
        return ConfigError(key, raw, f"is a list and cannot be null: give [] for an empty one ({key}=[])")
    return ConfigError(key, raw, f"is a list: write its entries in brackets, {key}=[{raw}] (several: "
                                 f"{key}=[a,b])")


def empty_dicts(overrides: Sequence[str]) -> list[str]:
    """The keys of dict sections the command line sets to `{}` (`algorithm.lr_scale={}`): Hydra merges a dict
    override into the experiment's dict, so `{}` would change nothing; `pipelines.compose` empties those keys
    instead (the one way to clear an experiment's entries from the command line: `~key` cannot delete a schema key).
    Overrides are Hydra `Override`s or strings."""
    out = []
    for ov in overrides:
        text = ov if isinstance(ov, str) else ov.input_line
        key, _, raw = text.partition("=")
        if key.startswith("~") or raw.strip() not in ("{}", "{ }"):
            continue
        key = key.lstrip("+")
        if isinstance(_slot(key, family_keys=True), DictConfig):
            out.append(key)
    return out


def _as_typed(text: str, ov) -> str:
    """One override `text` (parsed: `ov`) as Hydra must be given it (`as_typed`). Raises ConfigError."""
    if ov.is_delete():
        return text
    key, value = ov.key_or_group, ov.value()
    head, _, raw = text.partition("=")
    raw = raw.strip()
    if isinstance(value, dict):
        _check_typed_entries(key, value, raw, head)
        return text
    listed = None if key in ("conf", *GROUPS) else _list_fix(key, value, raw)
    if listed is not None:
        raise listed
    optional = True if key in ("conf", *GROUPS) else _str_slot(key)  # a group choice is a name (null: none)
    if optional is None or isinstance(value, (str, list)):
        return text
    if value is None:
        if optional:
            return text
        raise ConfigError(key, raw, f"is a string and cannot be null; give a value (for the text {raw} itself, quote "
                                    f"it: {key}=\"'{raw}'\" in the shell)")
    return f"{head}='{raw}'"  # a bool/int/float token: plain characters, safe inside Hydra's single quotes


def _check_typed_entries(key: str, value: dict, raw: str, head: str) -> None:
    """A dict value's entries of string keys must read as typed: refuse a bool, a float, or an integer Hydra
    wrote otherwise than it was typed (`1_0`, `+1`; the raw text of an entry is not kept by Hydra's parser)."""
    import re
    for name, v in value.items():
        sub = f"{key}.{name}"
        if isinstance(v, dict):
            _check_typed_entries(sub, v, raw, head)
            continue
        if isinstance(v, str) or v is None or isinstance(v, list) or _str_slot(sub) is None:
            continue
        if isinstance(v, int) and not isinstance(v, bool) and re.search(rf"(?<![\w.+-]){v}(?![\w.])", raw):
            continue  # written as Python prints it (actor: 0): the string "0" is what was typed
        kind = "a bool" if isinstance(v, bool) else "a number"
        raise ConfigError(sub, v, f"is a string, but Hydra reads this dict entry as {kind} (its text would change); "
                                  f"quote it inside the dict: {head.lstrip('+~')}={{{name}: 'VALUE'}} (in the shell: "
                                  f"'{head}={{{name}: \"VALUE\"}}')")


def _schema_default(key: str):
    """The schema default at `key` (a dict entry's parent dict when the entry is new), or None if unknown."""
    from tasks.config import config_value
    from pipelines.families import family_defaults
    for cfg in family_defaults():  # Config(), then a default Config of each family (a family key's default)
        try:
            return config_value(cfg, key)
        except KeyError:
            pass
    return None


def _expected(default) -> str | None:
    """'true or false', 'an integer' or 'a number' for a bool, int or float schema default (None otherwise)."""
    for kind, name in ((bool, "true or false"), (int, "an integer"), (float, "a number")):
        if isinstance(default, kind):
            return name
    return None


def _yaml(value) -> str:
    """A scalar as an override writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _comma_fix(key: str, value: str) -> str:
    default = _schema_default(key)
    if _expected(default) is not None:  # a number (or bool) key: a comma is no part of its value
        return f"{key} takes one value, {_expected(default)} (e.g. {key}={_yaml(default)}); no commas"
    if isinstance(default, list):
        return f"Hydra reads unbracketed commas as a sweep of runs; write the list in brackets: {key}=[{value}]"
    if isinstance(default, dict):
        return (f"Hydra reads unbracketed commas as a sweep of runs; write the dict in braces: "
                f"{key}='{{k: v, ...}}'")
    return (f"Hydra reads an unquoted comma as a sweep of runs; quote the value: {key}='\"{value}\"' "
            f"(in the shell: single quotes around double quotes) or escape the commas: {key}='{value.replace(',', chr(92) + ',')}'")


def _grammar_error(key: str, value: str) -> ConfigError:
    if "," in key:  # a dict key with commas (cluster.component_placement's "actor,env,rollout")
        parts = key.split(".")
        i = next(j for j, s in enumerate(parts) if "," in s)
        parent, name = ".".join(parts[:i]), ".".join(parts[i:])
        esc = name.replace(",", "\\,")
        return ConfigError(key, value, f"a key with commas cannot be written as a dotted key; give it inside a dict "
                                       f"value: '+{parent}={{{esc}: {value}}}'")
    if value.lstrip().startswith("{") and ("'" in value or '"' in value):
        return ConfigError(key, value, "Hydra's dict keys are unquoted; escape commas inside them instead: e.g. "
                                       "'+cluster.component_placement={actor\\,env\\,rollout: all}'")
    return ConfigError(key or "override", value, f"Hydra cannot parse this override; {QUOTING}")
