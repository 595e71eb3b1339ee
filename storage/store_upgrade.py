"""Rewrite a trajectory store of an older format into today's layout (``storage.trajectories``), for
``python -m pipelines.upgrade``: the one place that reads the older layouts (the zarr arrays opened directly).

Older layouts, what :func:`rewrite_store` makes of them (everything else is copied as it is):

  schema version 1      the per-step group is named ``epochs``: its arrays go to ``steps``; ``schema_version`` 2.
  no attempt arrays     ``steps/attempt`` = 1 for every allocated step (each was reserved once: ``reserve`` returns
                        1 on a step's first reservation); ``steps/shard_attempt`` = 1 for every shard of a complete
                        step and for the shards of another step whose chunk files are stored, else -1 (never
                        written): the complete steps stay exactly those ``steps/complete`` marks, as the older
                        reader showed them.
  no ``store_id``       a new random one (the store's identity from now on; ``created_at`` is kept).
  field codecs          every field is written with today's codecs (zstd with its content checksum).

Plus what the caller adds: attributes (``add_attrs``) and whole fields of one value (``add_fields``; the run-level
attrs and fields of ``pipelines.upgrade.store``). Field data is copied chunk by chunk (one env shard of one step); a
chunk file missing from the old store stays missing in the new one (damage is kept visible, never filled in).
:func:`verify_rewrite` reads the new store back through today's reader and compares every copied chunk, the
complete steps and the attributes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import zarr

from storage.trajectories import (_ARRAY_CONFIG, _ATTEMPT, _BOOKKEEPING, _COMPLETE, _FIELDS_GROUP, _RESERVED_ATTRS,
                                  _SHARD_ATTEMPT, _STEP_CHUNK, _STEPS_GROUP, SCHEMA_VERSION, FieldSpec,
                                  TrajectoryStore, old_parts)

_STEPS_GROUP_V1 = "epochs"


def _open_old(path: Path) -> zarr.Group:
    """The store group at `path`, any schema version this module rewrites (1 or today's)."""
    if not (path / "zarr.json").is_file():
        raise ValueError(f"{path} is not a trajectory store (no zarr.json)")
    group = zarr.open_group(str(path), mode="r")
    attrs = group.attrs.asdict()
    if "layout" not in attrs or attrs.get("schema_version") not in (1, SCHEMA_VERSION):
        raise ValueError(f"{path} is not a dagrl trajectory store of schema version 1 or {SCHEMA_VERSION}")
    return group


def store_old_parts(path: str | os.PathLike) -> list[str]:
    """What of the store at `path` is of an older layout (``storage.trajectories.old_parts``); [] when current."""
    return old_parts(_open_old(Path(path)))


def _steps(group: zarr.Group) -> zarr.Group:
    return group[_STEPS_GROUP_V1 if group.attrs["schema_version"] == 1 else _STEPS_GROUP]


def _chunk_present(arr: zarr.Array, root: Path, key: str, n: int, s: int) -> bool:
    chunk = arr.metadata.encode_chunk_key((n, 0, s) + (0,) * (arr.ndim - 3))
    return (root / key / chunk).is_file()


def old_complete(path: str | os.PathLike) -> np.ndarray:
    """The complete steps the older reader showed (int64, ascending): ``complete[n]``, and every shard on
    ``attempt[n]`` where the attempt arrays exist."""
    steps = _steps(_open_old(Path(path)))
    done = steps[_COMPLETE][:]
    if _ATTEMPT in steps and _SHARD_ATTEMPT in steps and done.any():
        done &= (steps[_SHARD_ATTEMPT][:] == steps[_ATTEMPT][:][:, None]).all(axis=1)[:done.shape[0]]
    return np.flatnonzero(done).astype(np.int64)


def rewrite_store(src: str | os.PathLike, dst: str | os.PathLike, *, add_attrs: Mapping[str, Any] | None = None,
                  add_fields: Mapping[str, tuple[FieldSpec, Any]] | None = None) -> None:
    """Write the store at `src` (any layout of the module docstring) as a new store at `dst` (must not exist) in
    today's layout, with `add_attrs` set where `src` lacks them and `add_fields` ({name: (spec, value)}) written
    whole with one value where `src` lacks the field. `src` is only read.

    Raises:
        ValueError: `src` is not a dagrl trajectory store; an added attribute or field collides with a stored one.
    """
    src, dst = Path(src), Path(dst)
    old = _open_old(src)
    attrs = old.attrs.asdict()
    layout = attrs["layout"]
    T, B, S = int(layout["T"]), int(layout["num_envs"]), int(layout["shard_size"])
    fields = {n: FieldSpec.from_json(d) for n, d in layout["fields"].items()}
    add_fields = {n: v for n, v in (add_fields or {}).items() if n not in fields}
    user = {k: v for k, v in attrs.items() if k not in _RESERVED_ATTRS}
    user.update({k: v for k, v in (add_attrs or {}).items() if k not in user})
    new = TrajectoryStore.create(dst, fields={**fields, **{n: spec for n, (spec, _) in add_fields.items()}},
                                 T=T, num_envs=B, shard_size=S, attrs=user)
    group = zarr.open_group(str(dst), mode="r+")
    if attrs.get("store_id"):
        group.attrs["store_id"] = attrs["store_id"]
    if attrs.get("created_at"):
        group.attrs["created_at"] = attrs["created_at"]
    steps_old = _steps(old)
    N = int(steps_old[_COMPLETE].shape[0])
    if N:
        new.reserve(N - 1)  # grows every array to N steps
    steps_new = group[_STEPS_GROUP]
    if _ATTEMPT in steps_old and _SHARD_ATTEMPT in steps_old:
        steps_new[_ATTEMPT][:] = steps_old[_ATTEMPT][:N]
        steps_new[_SHARD_ATTEMPT].with_config(_ARRAY_CONFIG)[:] = steps_old[_SHARD_ATTEMPT][:N]
    elif N:
        steps_new[_ATTEMPT][:] = 1  # each step reserved once
    for name in steps_old.array_keys():
        if name in _BOOKKEEPING:
            continue
        a = steps_old[name]
        b = steps_new.create_array(name, shape=(N,), chunks=(_STEP_CHUNK,), dtype=a.dtype, fill_value=a.fill_value)
        if N:
            b[:] = a[:N]
    written = np.zeros((N, B // S), bool)  # (step, shard) of which some field's chunk is stored
    for name in fields:
        key = f"{_FIELDS_GROUP}/{name}"
        a, b = old[key], group[key].with_config(_ARRAY_CONFIG)
        for n in range(min(N, a.shape[0])):
            for s in range(B // S):
                if _chunk_present(a, src, key, n, s):
                    b[n, :, s * S:(s + 1) * S] = a[n, :, s * S:(s + 1) * S]
                    written[n, s] = True
    if N and not (_ATTEMPT in steps_old and _SHARD_ATTEMPT in steps_old):
        # attempt 1 by every shard of a complete step (it was marked so), else by the shards whose chunks are stored
        done = steps_old[_COMPLETE][:N]
        steps_new[_SHARD_ATTEMPT].with_config(_ARRAY_CONFIG)[:] = np.where(done[:, None] | written, 1, -1)
    for name, (spec, value) in add_fields.items():  # where the shard wrote, as write_shard writes every field
        b = group[f"{_FIELDS_GROUP}/{name}"].with_config(_ARRAY_CONFIG)
        for n, s in zip(*np.nonzero(written)):
            b[n, :, s * S:(s + 1) * S] = np.full((T, S, *spec.shape), value, dtype=spec.dtype)
    steps_new[_COMPLETE][:] = steps_old[_COMPLETE][:N]  # last: what the older reader showed as complete


def verify_rewrite(src: str | os.PathLike, dst: str | os.PathLike,
                   add_fields: Mapping[str, tuple[FieldSpec, Any]] | None = None) -> None:
    """Read the store at `dst` back through today's reader and compare it with `src`: the layout's geometry, every
    caller attribute, the complete steps, every per-step scalar, every chunk `src` holds (bit for bit, NaN equal to
    NaN), and the added fields' value over the complete steps.

    Raises:
        ValueError: one line naming what differs.
    """
    src, dst = Path(src), Path(dst)
    old = _open_old(src)
    attrs = old.attrs.asdict()
    new = TrajectoryStore.open(dst)  # today's reader takes it (raises OldStore otherwise)
    got = new.attrs
    for k, v in attrs.items():
        if k not in ("schema_version", "store_id", "layout") and got.get(k) != v:
            raise ValueError(f"upgraded store {dst}: attribute {k} is {got.get(k)!r}, was {v!r}")
    lo, ln = attrs["layout"], got["layout"]
    kept = {n: ln["fields"].get(n) for n in lo["fields"]}
    if any(lo[k] != ln[k] for k in ("T", "num_envs", "shard_size")) or kept != lo["fields"] \
            or set(ln["fields"]) - set(lo["fields"]) - set(add_fields or {}):
        raise ValueError(f"upgraded store {dst}: layout {ln}, was {lo} (plus {sorted(add_fields or {})})")
    if not np.array_equal(new.complete_steps(), old_complete(src)):
        raise ValueError(f"upgraded store {dst}: complete steps {new.complete_steps().tolist()}, were "
                         f"{old_complete(src).tolist()}")
    steps_old = _steps(old)
    for name in steps_old.array_keys():
        if name not in _BOOKKEEPING and not np.array_equal(new.step_scalar(name), steps_old[name][:],
                                                           equal_nan=steps_old[name].dtype.kind == "f"):
            raise ValueError(f"upgraded store {dst}: per-step {name} differs")
    new.check_files()  # every chunk file of the complete steps is there (today's check, as every read runs it)
    S, raw = new.shard_size, zarr.open_group(str(dst), mode="r")
    for name in attrs["layout"]["fields"]:
        key = f"{_FIELDS_GROUP}/{name}"
        a, b = old[key], raw[key]
        for n in range(a.shape[0]):
            for s in range(new.num_shards):
                there = _chunk_present(a, src, key, n, s)
                if there != _chunk_present(b, dst, key, n, s):
                    raise ValueError(f"upgraded store {dst}: {key} step {n} shard {s}: chunk file "
                                     f"{'missing' if there else 'added'}")
                want = a[n, :, s * S:(s + 1) * S] if there else None
                if there and not np.array_equal(b[n, :, s * S:(s + 1) * S], want, equal_nan=want.dtype.kind == "f"):
                    raise ValueError(f"upgraded store {dst}: {key} step {n} shard {s} differs from {src}")
    done = new.complete_steps()
    for name, (spec, value) in (add_fields or {}).items():
        if name in attrs["layout"]["fields"] or not len(done):
            continue
        if not (new.read(name, done) == np.asarray(value, spec.dtype)).all():
            raise ValueError(f"upgraded store {dst}: added field {name} is not {value!r} everywhere")
