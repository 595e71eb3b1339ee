"""A process-wide memo for `pipelines.compose` (README "Tests": the unit tier composes the same configs hundreds of
times; one Hydra composition costs ~0.1 s of CPU, a conf file read a few ms).

A composition is a pure function of conf/'s files, the registered families and the overrides: `compose` keys it by
(CONF_DIR, `conf_digest` of every conf YAML file's path and bytes, the union schema class, which is a new one
whenever a family is registered (`pipelines.families.union_schema`), the overrides) and hands out a deep copy each
time, so no caller sees another's edits; a conf file edited, added or removed, or CONF_DIR pointed elsewhere, is a
new key. Errors are not kept (composed again, raised again). Kept the same way: the reads of single conf files
(`plain_yaml`, by path and bytes; a copy each time), the schema node of each section class (only read) and each
typed section (by its name, class and values; a copy each time: `pipelines.families.typed_config`), the schema's
key list (by union schema), the parsed overrides (by union schema and overrides: Hydra `Override` objects, only
read), the composition of a set of group choices (pipelines.compose_values), and the ConfigStore entry
`register_schema` made (`STORED`). Each table keeps its last MEMO_SIZE keys. `clear()` empties everything.
"""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any, Callable, Hashable

MEMO_SIZE = 256
_TABLES: dict[str, dict] = {}
STORED: list = []  # [(the union schema class, the ConfigStore node stored for it)] (pipelines.compose.register_schema)


def once(table: str, key: Hashable, build: Callable[[], Any]) -> Any:
    """`build()` for `key` of `table`, built at the first call and kept (the caller copies what it hands out)."""
    memo = _TABLES.setdefault(table, {})
    if key not in memo:
        memo[key] = build()
        if len(memo) > MEMO_SIZE:
            memo.pop(next(iter(memo)))  # the oldest
    return memo[key]


def clear() -> None:
    """Forget everything kept (the next composition runs Hydra again)."""
    _TABLES.clear()
    STORED.clear()


def conf_digest(conf_dir: Path) -> str:
    """blake2b of the relative path and bytes of every *.yaml under `conf_dir`, sorted: all Hydra may read."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(Path(conf_dir).rglob("*.yaml")):
        data = path.read_bytes()
        h.update(f"{path.relative_to(conf_dir)}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def plain_yaml(path: Path):
    """`OmegaConf.to_container(OmegaConf.load(path))` (plain, unresolved), kept by (path, its bytes); a deep copy
    each time. Raises FileNotFoundError, yaml.YAMLError as OmegaConf.load does."""
    from omegaconf import OmegaConf
    key = (str(path), Path(path).read_bytes())
    return copy.deepcopy(once("yaml", key, lambda: OmegaConf.to_container(OmegaConf.load(path))))
