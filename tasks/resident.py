"""Process-local registry of stateful things resident on a worker: env shards, policy replicas, the actor.

Graph nodes that need such state are pinned to the worker holding it (pipelines.graphs). A node that finds its
entry missing (a fresh worker after a loss) rebuilds it from its arguments (cursor, weights, checkpoint), so a lost
worker costs a re-created shard and a retried step, never wrong data.
"""
from __future__ import annotations

from typing import Any, Callable

_RESIDENT: dict[str, Any] = {}


def get_or_create(key: str, factory: Callable[[], Any]) -> tuple[Any, bool]:
    """Return (value, created) for `key`, building it with `factory()` when absent."""
    if key in _RESIDENT:
        return _RESIDENT[key], False
    value = factory()
    _RESIDENT[key] = value
    return value, True


def get(key: str, default: Any = None) -> Any:
    return _RESIDENT.get(key, default)


def put(key: str, value: Any) -> None:
    _RESIDENT[key] = value


def release(prefix: str) -> int:
    """Drop (and close, when they have `close()`) every entry whose key starts with `prefix`; return the count."""
    keys = [k for k in _RESIDENT if k.startswith(prefix)]
    for k in keys:
        value = _RESIDENT.pop(k)
        close = getattr(value, "close", None)
        if callable(close):
            close()
    return len(keys)


def keys() -> list[str]:
    return sorted(_RESIDENT)
