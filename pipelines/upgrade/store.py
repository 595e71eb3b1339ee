"""The trajectory store of `python -m pipelines.upgrade`: what a dagrl store of today holds beyond the storage layout,
the one-line refusal its readers give a store of an older format, and its rewrite.

Today a store written by `pipelines.run` or `pipelines.record` carries the attributes `simulator` and
`gripper_convention` and the fields `task_id` and `trial_id` (tasks.trajectory: stored always). Older stores lack
them; the upgrade adds what the writer would have written for the same data:

  simulator            "maniskill": the only simulator before the attribute existed.
  gripper_convention   the recorded simulator's (its adapter's GRIPPER_CONVENTION; ManiSkill's "open_positive",
                       what the older reader assumed).
  task_id              0 everywhere: such a store holds one task's episodes (the first selected task's prompt, which
                       the older reader used) and the writer stores 0 for a single-task simulator.
  trial_id             -1 everywhere for a simulator whose episodes start from the seed alone (its adapter maps no
                       seed to an init state: ManiSkill); for one that does (LIBERO) the trial cannot be recovered
                       from the store: refused.
  the env family's     what its adapter records (`store_attrs`) and an older store lacks, with the value the family
  attributes           says the data was recorded with (`tasks.envs.missing_store_attrs`; ManiSkill: an image
                       store's `robot_visual_lod`, its run's env.robot_visual_lod, else 1.0: the original meshes).

Plus the storage layout's own older forms (`storage.store_upgrade`: schema version 1, no attempt arrays, no
store_id). The rewrite writes a new store under the run's staging directory (`rewrite`), reads it back against the
old one (`storage.store_upgrade.verify_rewrite`), and the caller swaps the directories.
"""
from __future__ import annotations

import os
from pathlib import Path

from pipelines.upgrade.checkpoints import UpgradeError

STORE_DIR = "trajectories.zarr"
RUN_ATTRS = ("simulator", "gripper_convention")
RUN_FIELDS = ("task_id", "trial_id")
OLD_SIMULATOR = "maniskill"  # the simulator of every store written before the `simulator` attribute


def run_level_old(attrs: dict, fields) -> list[str]:
    """The run-level parts a store lacks (`RUN_ATTRS` attributes, its env family's attributes:
    `tasks.envs.missing_store_attrs`, `RUN_FIELDS` fields); [] when current.

    Raises:
        ConfigError: the store's `simulator` names no registered env family."""
    from tasks.envs import missing_store_attrs
    family = missing_store_attrs(attrs.get("simulator", OLD_SIMULATOR), attrs)
    return ([f"no {a} attribute" for a in RUN_ATTRS if a not in attrs]
            + [f"no {a} attribute" for a in family]
            + [f"no {f} field" for f in RUN_FIELDS if f not in fields])


def store_refusal(path: str | os.PathLike) -> str | None:
    """The one line a reader of the dagrl store at `path` gives when it is of an older format (storage layout or
    run level), else None. Opens the store (today's reader: a storage-level older form is its OldStore line).

    Raises:
        FileNotFoundError, ValueError: not a store (`TrajectoryStore.open`'s errors), damaged metadata."""
    from storage.trajectories import OldStore, TrajectoryStore, old_store_line
    try:
        store = TrajectoryStore.open(path)
    except OldStore as exc:
        return str(exc)
    old = run_level_old(store.attrs, store.fields)
    return old_store_line(path, ", ".join(old)) if old else None


def plan_store(path: Path) -> list[str]:
    """What of the store at `path` is old (storage layout and run level); [] when current or when there is none."""
    if not (path / "zarr.json").is_file():
        return []
    import zarr

    from storage.store_upgrade import store_old_parts
    parts = store_old_parts(path)
    group = zarr.open_group(str(path), mode="r")
    return parts + run_level_old(group.attrs.asdict(), group.attrs["layout"]["fields"])


def additions(path: Path, run_env: dict | None = None) -> tuple[dict, dict]:
    """(attributes, {field: (FieldSpec, value)}) the store at `path` gets (module docstring); `run_env`: the env
    section of its run's config (None or {}: a recording).

    Raises:
        UpgradeError: trial_id missing from a store of a simulator with init states (not recoverable)."""
    import zarr

    from storage.trajectories import FieldSpec
    from tasks.envs import adapter_of, missing_store_attrs
    from tasks.trajectory import FIELDS
    group = zarr.open_group(str(path), mode="r")
    attrs, fields = group.attrs.asdict(), group.attrs["layout"]["fields"]
    sim = attrs.get("simulator", OLD_SIMULATOR)
    adapter = adapter_of(sim)
    add_attrs = {"simulator": sim, "gripper_convention": adapter.GRIPPER_CONVENTION,
                 **missing_store_attrs(sim, attrs, run_env)}
    spec = {f.name: f for f in FIELDS}
    add_fields = {}
    if "task_id" not in fields:
        add_fields["task_id"] = (FieldSpec((), spec["task_id"].dtype), 0)
    if "trial_id" not in fields:
        if getattr(adapter, "reset_state_for_seed", None) is not None:
            raise UpgradeError(f"trajectory store {path}: no trial_id field, and env.simulator={sim} maps seeds to "
                               f"init states the store did not record: its trials cannot be recovered; not upgraded "
                               f"(re-record it)")
        add_fields["trial_id"] = (FieldSpec((), spec["trial_id"].dtype), -1)
    return add_attrs, add_fields


def rewrite(path: Path, stage: Path, run_env: dict | None = None) -> Path:
    """Write the store at `path` in today's format at `stage` / its name, read it back against the old one, and
    return the new store's path (the caller swaps it in). `run_env`: the env section of its run's config (None: a
    recording).

    Raises:
        UpgradeError: trial_id not recoverable; the new store differs from the old one (nothing swapped)."""
    from storage.store_upgrade import rewrite_store, verify_rewrite
    add_attrs, add_fields = additions(path, run_env)
    out = stage / path.name
    rewrite_store(path, out, add_attrs=add_attrs, add_fields=add_fields)
    try:
        verify_rewrite(path, out, add_fields)
    except ValueError as exc:
        raise UpgradeError(f"{exc}; not upgraded") from None
    old = plan_store(out)
    if old:
        raise UpgradeError(f"trajectory store {out}: still of an older format after the rewrite ({old}); not upgraded")
    return out
