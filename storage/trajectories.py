"""Zarr v3 trajectory store: one group per run, one array per field.

Layout of a store at ``path`` (a directory)::

    path/                      group; attributes: schema_version, created_at, layout, + caller attrs
      fields/<name>            [E, T, B, *shape]  chunks (1, T, shard_size, *shape)
      epochs/complete          [E] bool           set by the driver once every shard of epoch e's latest attempt
                                                  was written (cleared by a new attempt and by `invalidate_from`)
      epochs/attempt           [E] int64          the epoch's latest attempt id (0: never reserved for writing)
      epochs/shard_attempt     [E, S] int64       the attempt each shard last wrote (-1: never); chunks (1, 1)
      epochs/<scalar>          [E]                per-epoch scalars (weight_version, global_step, ...)

``E`` is the rollout epoch (= training step index), ``T`` the chunk steps, ``B`` the envs, ``S`` the shards.

Attempts (data shown once, and only when whole): a step that is redone (a retry after a lost worker, a rollback
to a checkpoint, a resume) calls :meth:`TrajectoryStore.reserve` again, which starts a new attempt of the epoch
(``attempt[e] += 1``, ``complete[e] = False``). :func:`write_shard` records the attempt it wrote; an epoch is
complete (:meth:`TrajectoryStore.complete_epochs`, the one reader API: replay, SFT's ``sft.store``, the episode
index) only when ``complete[e]`` is set AND every shard's ``shard_attempt`` equals ``attempt[e]``, so a half-rewritten
epoch (shard 0 new, shard 1 old) is never shown. A rollback or resume to step k calls
:meth:`TrajectoryStore.invalidate_from` (k): epochs >= k are not complete until they are redone.
Stores written before attempts existed (no ``epochs/attempt``) read as before: ``complete[e]`` alone.

Concurrency (zarr 3 loses data when two writers touch one chunk, and on concurrent resizes):

* the driver alone creates the store, grows ``E`` with :meth:`TrajectoryStore.reserve` and flips
  ``epochs/complete`` with :meth:`TrajectoryStore.mark_complete`;
* workers call :func:`write_shard` inside Dask tasks; shard ``s`` of epoch ``e`` covers exactly the chunk
  ``(e, 0, s, 0...)`` of every field array, so no two tasks ever write the same chunk.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

SCHEMA_VERSION = 1

_RESERVED_ATTRS = ("schema_version", "created_at", "layout")
_FIELDS_GROUP = "fields"
_EPOCHS_GROUP = "epochs"
_COMPLETE = "complete"
_ATTEMPT = "attempt"
_SHARD_ATTEMPT = "shard_attempt"
_BOOKKEEPING = (_COMPLETE, _ATTEMPT, _SHARD_ATTEMPT)  # epoch arrays that are not per-epoch scalars
_EPOCH_CHUNK = 1024
_ARRAY_CONFIG = {"write_empty_chunks": True}


@dataclass(frozen=True)
class FieldSpec:
    """One stored field: ``shape`` are the trailing dims after ``[T, B]``, ``dtype`` a numpy dtype name."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"FieldSpec.shape must hold non-negative ints, got {self.shape!r}")
        try:
            dt = np.dtype(self.dtype)
        except TypeError as e:
            raise ValueError(f"FieldSpec.dtype {self.dtype!r} is not a numpy dtype: {e}") from None
        if dt.kind in "OVUSMm":
            raise ValueError(f"FieldSpec.dtype {self.dtype!r} is not a fixed-size numeric/bool dtype")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dt.name)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FieldSpec:
        return cls(shape=tuple(d["shape"]), dtype=d["dtype"])


def _check_json_attrs(attrs: Mapping[str, Any]) -> None:
    for key, value in attrs.items():
        if not isinstance(key, str):
            raise ValueError(f"trajectory store attribute keys must be str, got {key!r}")
        if key in _RESERVED_ATTRS:
            raise ValueError(f"attribute {key!r} is reserved by the trajectory store; rename it")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"trajectory store attribute {key!r} is not JSON-serialisable ({type(value).__name__}: {e}); "
                "convert it first (e.g. ndarray.tolist(), int(np_int), str(path))"
            ) from None


def _layout(fields: Mapping[str, FieldSpec], T: int, num_envs: int, shard_size: int) -> dict[str, Any]:
    return {
        "T": int(T),
        "num_envs": int(num_envs),
        "shard_size": int(shard_size),
        "fields": {name: spec.to_json() for name, spec in sorted(fields.items())},
    }


def _layout_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    diffs = [f"{k}: stored {old.get(k)!r}, asked {new[k]!r}" for k in ("T", "num_envs", "shard_size")
             if old.get(k) != new[k]]
    of, nf = old.get("fields", {}), new["fields"]
    for name in sorted(set(of) | set(nf)):
        if name not in nf:
            diffs.append(f"field {name!r}: stored, not asked")
        elif name not in of:
            diffs.append(f"field {name!r}: asked, not stored")
        elif of[name] != nf[name]:
            diffs.append(f"field {name!r}: stored {of[name]}, asked {nf[name]}")
    return diffs


def _is_zarr_group(path: Path) -> bool:
    return (path / "zarr.json").is_file()


def _open_group(path: Path, mode: str = "r+") -> zarr.Group:
    """Open ``path`` as a dagrl store group, with clear errors when it is not one."""
    if not path.exists():
        raise FileNotFoundError(f"no trajectory store at {path}: the path does not exist")
    if not _is_zarr_group(path):
        raise ValueError(f"{path} is not a dagrl trajectory store (no zarr v3 group metadata zarr.json there)")
    group = zarr.open_group(str(path), mode=mode)
    version = group.attrs.get("schema_version")
    if version is None or "layout" not in group.attrs:
        raise ValueError(f"{path} is a zarr group but not a dagrl trajectory store (no schema_version/layout attrs)")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"trajectory store at {path} has schema_version {version}, this dagrl reads {SCHEMA_VERSION}; "
            "read it with a matching dagrl version or start a new run directory"
        )
    return group


class TrajectoryStore:
    """Driver-side handle on one run's trajectory store. Use :meth:`create` or :meth:`open`."""

    def __init__(self, path: str | os.PathLike, group: zarr.Group):
        self._path = Path(path)
        self._group = group
        attrs = group.attrs.asdict()
        layout = attrs["layout"]
        self._T = int(layout["T"])
        self._num_envs = int(layout["num_envs"])
        self._shard_size = int(layout["shard_size"])
        self._fields = {name: FieldSpec.from_json(d) for name, d in layout["fields"].items()}

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        *,
        fields: Mapping[str, FieldSpec],
        T: int,
        num_envs: int,
        shard_size: int,
        attrs: Mapping[str, Any] | None = None,
    ) -> TrajectoryStore:
        """Create a store with ``E = 0`` epochs, or reopen an identical one at ``path`` (resume).

        Reopening keeps the stored attributes; caller attrs not yet stored are added.
        """
        path = Path(path)
        attrs = dict(attrs or {})
        if T <= 0 or num_envs <= 0 or shard_size <= 0:
            raise ValueError(f"T, num_envs and shard_size must be positive, got T={T}, num_envs={num_envs}, "
                             f"shard_size={shard_size}")
        if num_envs % shard_size != 0:
            raise ValueError(f"num_envs={num_envs} is not a multiple of shard_size={shard_size}; "
                             "choose a shard_size that divides num_envs")
        if not fields:
            raise ValueError("a trajectory store needs at least one field")
        fields = {name: spec if isinstance(spec, FieldSpec) else FieldSpec(**spec) for name, spec in fields.items()}
        for name in fields:
            if not name or "/" in name or name.startswith("."):
                raise ValueError(f"field name {name!r} is not a valid array name (no '/', not empty, no leading '.')")
        _check_json_attrs(attrs)
        layout = _layout(fields, T, num_envs, shard_size)

        if path.exists() and _is_zarr_group(path):
            group = _open_group(path)
            diffs = _layout_diff(group.attrs["layout"], layout)
            if diffs:
                raise ValueError(
                    f"trajectory store at {path} already exists with a different layout ("
                    + "; ".join(diffs)
                    + "). Use a new run directory, or delete the old store to start over."
                )
            missing = {k: v for k, v in attrs.items() if k not in group.attrs}
            if missing:
                group.attrs.update(missing)
            _ensure_attempt_arrays(group, num_envs // shard_size)
            return cls(path, group)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ValueError(f"{path} exists and is not an empty directory nor a trajectory store; pick another path")

        group = zarr.open_group(str(path), mode="w-")
        group.attrs.update({
            "schema_version": SCHEMA_VERSION,
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "layout": layout,
            **attrs,
        })
        fg = group.create_group(_FIELDS_GROUP)
        for name, spec in fields.items():
            fg.create_array(
                name,
                shape=(0, T, num_envs, *spec.shape),
                chunks=(1, T, shard_size, *spec.shape),
                dtype=spec.dtype,
                fill_value=0,
                config=_ARRAY_CONFIG,
            )
        eg = group.create_group(_EPOCHS_GROUP)
        eg.create_array(_COMPLETE, shape=(0,), chunks=(_EPOCH_CHUNK,), dtype="bool", fill_value=False)
        _ensure_attempt_arrays(group, num_envs // shard_size)
        return cls(path, group)

    @classmethod
    def open(cls, path: str | os.PathLike) -> TrajectoryStore:
        path = Path(path)
        return cls(path, _open_group(path))

    # ---- properties ------------------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self._path

    @property
    def fields(self) -> dict[str, FieldSpec]:
        return dict(self._fields)

    @property
    def T(self) -> int:
        return self._T

    @property
    def num_envs(self) -> int:
        return self._num_envs

    @property
    def shard_size(self) -> int:
        return self._shard_size

    @property
    def num_shards(self) -> int:
        return self._num_envs // self._shard_size

    @property
    def num_epochs(self) -> int:
        """Allocated epochs ``E`` (complete or not)."""
        return int(self._epoch_array(_COMPLETE).shape[0])

    @property
    def attrs(self) -> dict[str, Any]:
        return zarr.open_group(str(self._path), mode="r").attrs.asdict()

    @property
    def epoch_scalar_names(self) -> list[str]:
        return sorted(n for n in self._group[_EPOCHS_GROUP].array_keys() if n not in _BOOKKEEPING)

    # ---- driver-side writes ----------------------------------------------------------------------------
    def update_attrs(self, **attrs: Any) -> None:
        """Add or replace caller attributes (JSON-serialisable; reserved names raise ValueError)."""
        _check_json_attrs(attrs)
        self._group.attrs.update(attrs)

    def reserve(self, epoch: int) -> int:
        """Start a new attempt at writing ``epoch``: grow ``E`` so that ``E >= epoch + 1`` (never shrinks), bump
        ``attempt[epoch]`` and clear ``complete[epoch]`` (a redone step's epoch is not shown until every shard of
        the new attempt is written). Writes no field data. Driver only.

        Returns:
            the epoch's new attempt id (int >= 1); :func:`write_shard` records it per shard.
        Raises:
            ValueError: a negative epoch.
        """
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        need = epoch + 1
        if need > self.num_epochs:
            arrays = [self._field_array(n) for n in self._fields]
            arrays += [self._epoch_array(n) for n in [*self.epoch_scalar_names, _SHARD_ATTEMPT, _ATTEMPT, _COMPLETE]
                       if n in self._group[_EPOCHS_GROUP]]  # `complete` last: it defines E
            for arr in arrays:
                if arr.shape[0] < need:
                    arr.resize((need, *arr.shape[1:]))
        self._epoch_array(_COMPLETE)[epoch] = False  # first: a reader never sees the epoch complete mid-attempt
        if not self._has_attempts():
            return 1
        att = self._epoch_array(_ATTEMPT)
        new = int(att[epoch]) + 1
        att[epoch] = new
        return new

    def attempt(self, epoch: int) -> int:
        """The latest attempt id of ``epoch`` (0: never reserved; 1 for stores written before attempts existed)."""
        if not self._has_attempts():
            return 1
        return int(self._epoch_array(_ATTEMPT)[int(epoch)])

    def invalidate_from(self, epoch: int) -> list[int]:
        """A rollback or resume to training step ``epoch``: epochs ``>= epoch`` stop being complete (their data
        belongs to a superseded timeline and is shown again only once redone). Driver only.

        Returns:
            the epochs that were complete and are not any more.
        """
        epoch = max(0, int(epoch))
        E = self.num_epochs
        if epoch >= E:
            return []
        done = self._epoch_array(_COMPLETE)
        was = np.flatnonzero(done[epoch:E]) + epoch
        if was.size:
            done[epoch:E] = False
        return [int(e) for e in was]

    def shards_written(self, epoch: int) -> np.ndarray:
        """Bool ``[S]``: whether each shard has written the latest attempt of ``epoch``."""
        epoch = int(epoch)
        if not self._has_attempts():
            return np.ones(self.num_shards, bool)
        return self._epoch_array(_SHARD_ATTEMPT)[epoch] == self._epoch_array(_ATTEMPT)[epoch]

    def mark_complete(self, epoch: int, **per_epoch_scalars: Any) -> None:
        """Record per-epoch scalars (e.g. ``weight_version``, ``global_step``) and set ``complete[epoch]``.

        Raises:
            ValueError: the epoch is not allocated, or a shard has not written the epoch's latest attempt (the
                message names the shards and the attempts they hold).
        """
        epoch = int(epoch)
        E = self.num_epochs
        if not 0 <= epoch < E:
            raise ValueError(f"epoch {epoch} is not allocated in {self._path} (E={E}); call reserve({epoch}) first")
        written = self.shards_written(epoch)
        if not written.all():
            held = self._epoch_array(_SHARD_ATTEMPT)[epoch]
            missing = np.flatnonzero(~written).tolist()
            raise ValueError(f"epoch {epoch} of {self._path}: shard(s) {missing} have not written its latest attempt "
                             f"{self.attempt(epoch)} (they hold attempt(s) {held[missing].tolist()}, -1 = never); "
                             f"it cannot be marked complete")
        eg = self._group[_EPOCHS_GROUP]
        for name, value in per_epoch_scalars.items():
            if name in _BOOKKEEPING or "/" in name:
                raise ValueError(f"per-epoch scalar name {name!r} is reserved or invalid")
            value = np.asarray(value)
            if value.ndim != 0:
                raise ValueError(f"per-epoch scalar {name!r} must be a scalar, got shape {value.shape}")
            if name not in eg:
                if value.dtype.kind == "b":
                    dtype, fill = "bool", False
                elif value.dtype.kind in "iu":
                    dtype, fill = "int64", -1
                elif value.dtype.kind == "f":
                    dtype, fill = "float64", math.nan
                else:
                    raise ValueError(f"per-epoch scalar {name!r} must be bool/int/float, got {value.dtype}")
                eg.create_array(name, shape=(E,), chunks=(_EPOCH_CHUNK,), dtype=dtype, fill_value=fill)
            arr = self._epoch_array(name)
            cast = value.astype(arr.dtype)
            if arr.dtype.kind != "f" and cast.item() != value.item():
                raise ValueError(f"per-epoch scalar {name!r}={value.item()!r} does not fit stored dtype {arr.dtype}")
            arr[epoch] = cast
        self._epoch_array(_COMPLETE)[epoch] = True

    # ---- reads -----------------------------------------------------------------------------------------
    def complete_epochs(self) -> np.ndarray:
        """Epochs whose latest attempt is whole: ``complete[e]`` set and every shard wrote ``attempt[e]``.
        int64 ``[n]``, ascending. The one list every reader of a store's data should use."""
        done = self._epoch_array(_COMPLETE)[:]
        if self._has_attempts() and done.any():
            whole = (self._epoch_array(_SHARD_ATTEMPT)[:] == self._epoch_array(_ATTEMPT)[:][:, None]).all(axis=1)
            done &= whole[:done.shape[0]]
        return np.flatnonzero(done).astype(np.int64)

    def epoch_scalar(self, name: str) -> np.ndarray:
        """Per-epoch scalar array ``[E]`` (int fill -1, float fill NaN where never set)."""
        if name not in _BOOKKEEPING and name not in self.epoch_scalar_names:
            raise KeyError(f"no per-epoch scalar {name!r} in {self._path}; known: {self.epoch_scalar_names}")
        return self._epoch_array(name)[:]

    def to_dask(self, field: str):
        """Lazy ``[E, T, B, ...]`` dask array, one dask chunk per zarr chunk (epoch x shard)."""
        import dask.array as da

        return da.from_zarr(self._field_array(field))

    def read(self, field: str, epochs: Iterable[int] | None = None) -> np.ndarray:
        arr = self._field_array(field)
        if epochs is None:
            return arr[:]
        idx = np.asarray(list(epochs), dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= arr.shape[0]):
            raise IndexError(f"epochs {idx.tolist()} out of range for E={arr.shape[0]} in {self._path}")
        return arr.oindex[idx]

    # ---- helpers ---------------------------------------------------------------------------------------
    def _field_array(self, name: str) -> zarr.Array:
        if name not in self._fields:
            raise KeyError(f"no field {name!r} in {self._path}; known fields: {sorted(self._fields)}")
        return self._group[f"{_FIELDS_GROUP}/{name}"]

    def _epoch_array(self, name: str) -> zarr.Array:
        return self._group[f"{_EPOCHS_GROUP}/{name}"]

    def _has_attempts(self) -> bool:
        return _ATTEMPT in self._group[_EPOCHS_GROUP]


def _ensure_attempt_arrays(group: zarr.Group, num_shards: int) -> None:
    """Add ``epochs/attempt`` and ``epochs/shard_attempt`` to a store (new, or written before attempts existed:
    its complete epochs count as attempt 1 written by every shard). Driver only."""
    eg = group[_EPOCHS_GROUP]
    E = int(eg[_COMPLETE].shape[0])
    if _ATTEMPT not in eg:
        att = eg.create_array(_ATTEMPT, shape=(E,), chunks=(_EPOCH_CHUNK,), dtype="int64", fill_value=0)
        if E:
            att[:] = 1
    if _SHARD_ATTEMPT not in eg:
        sa = eg.create_array(_SHARD_ATTEMPT, shape=(E, num_shards), chunks=(1, 1), dtype="int64", fill_value=-1,
                             config=_ARRAY_CONFIG)
        if E:
            sa[:] = 1

    def __repr__(self) -> str:
        return (f"TrajectoryStore({str(self._path)!r}, E={self.num_epochs}, T={self._T}, B={self._num_envs}, "
                f"shard_size={self._shard_size}, fields={sorted(self._fields)})")


# ---- worker side -----------------------------------------------------------------------------------------
@dataclass
class _Opened:
    E: int
    T: int
    num_envs: int
    shard_size: int
    fields: dict[str, FieldSpec]
    arrays: dict[str, zarr.Array]
    attempt: zarr.Array | None = None  # epochs/attempt (None: a store written before attempts existed)
    shard_attempt: zarr.Array | None = None


_CACHE: dict[str, _Opened] = {}
_CACHE_LOCK = threading.Lock()


def _open_for_write(path: str) -> _Opened:
    group = _open_group(Path(path))
    layout = group.attrs["layout"]
    fields = {name: FieldSpec.from_json(d) for name, d in layout["fields"].items()}
    arrays = {name: group[f"{_FIELDS_GROUP}/{name}"].with_config(_ARRAY_CONFIG) for name in fields}
    eg = group[_EPOCHS_GROUP]
    att = eg[_ATTEMPT] if _ATTEMPT in eg else None
    sha = eg[_SHARD_ATTEMPT].with_config(_ARRAY_CONFIG) if _SHARD_ATTEMPT in eg else None
    E = min([a.shape[0] for a in arrays.values()] + [a.shape[0] for a in (att, sha) if a is not None] or [0])
    return _Opened(E, int(layout["T"]), int(layout["num_envs"]), int(layout["shard_size"]), fields, arrays, att, sha)


def clear_cache() -> None:
    """Forget the per-process cache of stores opened by :func:`write_shard`."""
    with _CACHE_LOCK:
        _CACHE.clear()


def write_shard(path: str, *, epoch: int, shard: int, data: Mapping[str, np.ndarray],
                attempt: int | None = None) -> dict[str, float]:
    """Write one env shard of one epoch: region ``[epoch, :, shard*S:(shard+1)*S]`` of every field, then record
    in ``epochs/shard_attempt[epoch, shard]`` the attempt it belongs to.

    Runs inside Dask tasks. ``data[name]`` must be ``[T, shard_size, *spec.shape]`` with the field's exact
    dtype (no casting). The epoch must have been reserved by the driver. ``attempt``: the id
    :meth:`TrajectoryStore.reserve` returned for this write (None: the epoch's latest attempt when the write
    starts). Returns ``{"bytes", "seconds"}`` (bytes = uncompressed payload).
    """
    t0 = time.perf_counter()
    key = os.path.abspath(os.fspath(path))
    epoch, shard = int(epoch), int(shard)
    with _CACHE_LOCK:
        opened = _CACHE.get(key)
    if opened is None or epoch >= opened.E:
        opened = _open_for_write(key)
        with _CACHE_LOCK:
            _CACHE[key] = opened
    if not 0 <= epoch < opened.E:
        raise ValueError(f"epoch {epoch} is not allocated in {key} (E={opened.E}); "
                         "the driver must call TrajectoryStore.reserve(epoch) before the shard writes")
    num_shards = opened.num_envs // opened.shard_size
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} out of range [0, {num_shards}) for {key}")
    missing = sorted(set(opened.fields) - set(data))
    extra = sorted(set(data) - set(opened.fields))
    if missing or extra:
        raise ValueError(f"write_shard to {key}: missing fields {missing}, unknown fields {extra}; "
                         f"expected exactly {sorted(opened.fields)}")
    arrays = {}
    for name, spec in opened.fields.items():
        value = np.asarray(data[name])
        expected = (opened.T, opened.shard_size, *spec.shape)
        if value.shape != expected:
            raise ValueError(f"field {name!r}: expected shape {expected} ([T, shard_size, ...]), got {value.shape}")
        if value.dtype != np.dtype(spec.dtype):
            raise ValueError(f"field {name!r}: expected dtype {spec.dtype}, got {value.dtype}")
        arrays[name] = value
    if attempt is None and opened.attempt is not None:
        attempt = int(opened.attempt[epoch])
    lo, hi = shard * opened.shard_size, (shard + 1) * opened.shard_size
    nbytes = 0
    for name, value in arrays.items():
        opened.arrays[name][epoch, :, lo:hi] = value
        nbytes += value.nbytes
    if opened.shard_attempt is not None:  # last: the shard counts as written only once its data is
        opened.shard_attempt[epoch, shard] = int(attempt)
    return {"bytes": nbytes, "seconds": time.perf_counter() - t0}


# ---- summary ---------------------------------------------------------------------------------------------
def _ranges(idx: np.ndarray) -> str:
    if idx.size == 0:
        return "none"
    parts, start, prev = [], int(idx[0]), int(idx[0])
    for i in idx[1:].tolist() + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def describe(path: str | os.PathLike) -> str:
    """Short human summary: layout, fields with shapes and dtypes, complete epochs, attributes."""
    store = TrajectoryStore.open(path)
    E = store.num_epochs
    done = store.complete_epochs()
    attrs = store.attrs
    lines = [
        f"trajectory store {store.path} (schema {attrs['schema_version']}, created {attrs.get('created_at')})",
        f"  T={store.T} num_envs={store.num_envs} shard_size={store.shard_size} ({store.num_shards} shards)",
        f"  epochs allocated={E} complete={done.size}: {_ranges(done)}",
        "  fields:",
    ]
    width = max(len(n) for n in store.fields)
    for name, spec in store.fields.items():
        dims = ", ".join(str(d) for d in (E, store.T, store.num_envs, *spec.shape))
        lines.append(f"    {name:<{width}}  [{dims}] {spec.dtype}")
    if store.epoch_scalar_names:
        lines.append(f"  per-epoch: {', '.join(store.epoch_scalar_names)}")
    user = {k: v for k, v in attrs.items() if k not in _RESERVED_ATTRS}
    for k, v in user.items():
        text = json.dumps(v)
        lines.append(f"  {k} = {text if len(text) <= 80 else text[:77] + '...'}")
    return "\n".join(lines)
