"""A changed copy of a built config: the sections are frozen dataclasses, so a config that differs in some keys is a
new object made with `dataclasses.replace`, section by section, and the original stays as it was.

    cfg2 = replace_key(cfg, "algorithm.lr", 1e-3)
    cfg3 = replace_keys(cfg, {"env.num_envs": 4, "env.num_shards": 2, "env.eval.num_episodes": 8})

A key is a dotted path of field names from the object given (a `Config`, or any section: `replace_key(cfg.env,
"eval.seed", 7)`); a value may be a whole section (`replace_key(cfg, "policy", PI0PolicyConfig())`). No rule runs
here: `tasks.config.check_config` checks the result when the caller needs a checked config (a test that builds a
bad config on purpose does not). To compose from conf/ with overrides instead, use `pipelines.config.load_config`.
This module imports nothing of dagrl but tasks.config.errors.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

from tasks.config.errors import ConfigError, did_you_mean

T = TypeVar("T")


def replace_key(obj: T, key: str, value: Any) -> T:
    """A copy of dataclass `obj` (a `Config` or a section) with the field at dotted `key` set to `value`; every
    section on the path is a new object (`dataclasses.replace`, so a class's `__post_init__` runs again), the others
    are shared with `obj`, which is not changed.

    Raises:
        ConfigError: key `key`: a part of it names no field of the section it is looked up in (did-you-mean among
            that section's fields), or goes below a value that is no dataclass.
    """
    head, _, rest = key.partition(".")
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise ConfigError(key, value, f"{type(obj).__name__} is not a config section: no key {head!r} below it")
    names = [f.name for f in dataclasses.fields(obj) if f.init]
    if head not in names:
        hint = did_you_mean(head, names)
        raise ConfigError(key, value, f"{type(obj).__name__} has no key {head!r}" + (f"; {hint}" if hint else "")
                          + f" (its keys: {names})")
    if rest:
        try:
            value = replace_key(getattr(obj, head), rest, value)
        except ConfigError as exc:  # name the whole dotted key
            raise ConfigError(key, value, exc.fix) from None
    return dataclasses.replace(obj, **{head: value})


def replace_keys(obj: T, values: Mapping[str, Any]) -> T:
    """`replace_key` for each `dotted key -> value` of `values`, in order (a later key below an earlier one's section
    applies to the new section). Raises ConfigError as `replace_key`."""
    for key, value in values.items():
        obj = replace_key(obj, key, value)
    return obj
