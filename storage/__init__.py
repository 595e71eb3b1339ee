"""Storage for dagrl runs: zarr trajectory store, MLflow tracking, atomic checkpoints, run directories.

Imports nothing else of dagrl. Re-exports are lazy (PEP 562) so that a Dask worker importing
``storage.trajectories`` for :func:`write_shard` does not pay for importing mlflow and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SCHEMA_VERSION": "trajectories",
    "FieldSpec": "trajectories",
    "TrajectoryStore": "trajectories",
    "describe": "trajectories",
    "write_shard": "trajectories",
    "Tracker": "tracking",
    "default_tracking_uri": "tracking",
    "flatten_config": "tracking",
    "checkpoint_dir": "checkpoints",
    "checkpoint_step": "checkpoints",
    "latest_checkpoint": "checkpoints",
    "list_checkpoints": "checkpoints",
    "load_checkpoint": "checkpoints",
    "prune_checkpoints": "checkpoints",
    "save_checkpoint": "checkpoints",
    "find_run_dir": "rundir",
    "new_run_dir": "rundir",
    "write_resolved_config": "rundir",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from storage.checkpoints import (
        checkpoint_dir,
        checkpoint_step,
        latest_checkpoint,
        list_checkpoints,
        load_checkpoint,
        prune_checkpoints,
        save_checkpoint,
    )
    from storage.rundir import find_run_dir, new_run_dir, write_resolved_config
    from storage.tracking import Tracker, default_tracking_uri, flatten_config
    from storage.trajectories import SCHEMA_VERSION, FieldSpec, TrajectoryStore, describe, write_shard


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"storage.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
