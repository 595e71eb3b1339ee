"""Zarr v3 trajectory store: one group per run, one array per field, indexed by training step.

Layout of a store at ``path`` (a directory), schema version 2::

    path/                      group; attributes: schema_version, created_at, layout, + caller attrs
      fields/<name>            [N, T, B, *shape]  chunks (1, T, shard_size, *shape)
      steps/complete           [N] bool           set by the driver once every shard of step n's latest attempt
                                                  was written (cleared by a new attempt and by `invalidate_from`)
      steps/attempt            [N] int64          the step's latest attempt id (0: never reserved for writing)
      steps/shard_attempt      [N, S] int64       the attempt each shard last wrote (-1: never); chunks (1, 1)
      steps/<scalar>           [N]                per-step scalars (weight_version, global_step, ...)

``N`` is the training step (a store written by ``pipelines.record``: the recording round), ``T`` the chunk steps,
``B`` the envs, ``S`` the shards. The field names, shapes and meanings of a training run's store are the stored
fields of ``tasks.trajectory`` (the one spec; docs/reference/trajectory.md).

Older formats (schema version 1, a store without the attempt arrays or without ``store_id``) are refused where a
store is opened (:class:`OldStore`: one line naming the store and ``python -m pipelines.upgrade``, which rewrites it
once; ``storage.store_upgrade``). Readers and writers see today's layout only.

Attempts (data shown once, and only when whole): a step that is redone (a retry after a lost worker, a rollback
to a checkpoint, a resume) calls :meth:`TrajectoryStore.reserve` again, which starts a new attempt of the step
(``attempt[n] += 1``, ``complete[n] = False``). :func:`write_shard` records the attempt it wrote; a step is
complete (:meth:`TrajectoryStore.complete_steps`, the one reader API: replay, SFT's ``sft.store``, the episode
index) only when ``complete[n]`` is set AND every shard's ``shard_attempt`` equals ``attempt[n]``, so a
half-rewritten step (shard 0 new, shard 1 old) is never shown. A rollback or resume to step k calls
:meth:`TrajectoryStore.invalidate_from` (k): steps >= k are not complete until they are redone.

Damage (files lost or garbled after the run wrote them): zarr reads a missing chunk file as the fill value, zeros,
without a word. Every shard write stores all its chunk files, so a chunk file missing from a written step is damage.
The one read path checks for it: :meth:`TrajectoryStore.read` (and :meth:`TrajectoryStore.gather`,
:meth:`TrajectoryStore.to_dask`, built on the same check) stats the chunk files of the steps it returns before
returning data, and turns a chunk that cannot be decoded into the same error: :class:`DamagedStore`, one line
naming the store, the array, the chunk file with its step and envs, and the fix. Readers read fields through these
methods only (never ``zarr.open`` on a store); :meth:`TrajectoryStore.check_files` runs the same check without
reading (a config check, replay's up-front check).

Identity: a store carries a random ``store_id`` attribute; :meth:`TrajectoryStore.fingerprint` (the id plus a digest
of the layout, the complete steps with their attempts and the caller attributes) tells two recordings at one path
apart without reading field data.

Concurrency (zarr 3 loses data when two writers touch one chunk, and on concurrent resizes):

* the driver alone creates the store, grows ``N`` with :meth:`TrajectoryStore.reserve` and flips
  ``steps/complete`` with :meth:`TrajectoryStore.mark_complete`;
* workers call :func:`write_shard` inside Dask tasks; shard ``s`` of step ``n`` covers exactly the chunk
  ``(n, 0, s, 0...)`` of every field array, so no two tasks ever write the same chunk.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

SCHEMA_VERSION = 2

_RESERVED_ATTRS = ("schema_version", "created_at", "layout", "store_id")
_FIELDS_GROUP = "fields"
_STEPS_GROUP = "steps"
_COMPLETE = "complete"
_ATTEMPT = "attempt"
_SHARD_ATTEMPT = "shard_attempt"
_BOOKKEEPING = (_COMPLETE, _ATTEMPT, _SHARD_ATTEMPT)  # per-step arrays that are not per-step scalars
_STEP_CHUNK = 1024
_ARRAY_CONFIG = {"write_empty_chunks": True}
# zarr 3's default compressor for numbers (zstd, level 0) with zstd's content checksum on: a flipped bit in a field's
# chunk file is a decode error ("Restored data doesn't match checksum") that the verified read names, instead of a
# value read back silently changed. A store written before keeps its own codecs in its metadata (no checksum; zarr
# reads them as they are); `python -m pipelines.upgrade` writes today's when it rewrites a store of an older format.
_FIELD_COMPRESSORS = (zarr.codecs.ZstdCodec(level=0, checksum=True),)


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


class DamagedStore(ValueError):
    """A trajectory store whose files contradict its own metadata: a field's array metadata missing or unreadable,
    or a chunk file of a complete step missing (zarr would read it as the fill value, silently) or not decodable.
    The message is one line naming the store, the array, the chunk file (step, envs) where known and the fix."""


class OldStore(ValueError):
    """A trajectory store of an older format (module docstring): one line naming the store, what is old and the fix,
    ``python -m pipelines.upgrade <its run directory, or the store>``."""


def upgrade_target(path: str | os.PathLike) -> Path:
    """What ``python -m pipelines.upgrade`` takes to rewrite the store at ``path``: its run directory when it is a
    run's store (``<run_dir>/trajectories.zarr`` beside ``config.yaml``), else the store itself (a recording)."""
    path = Path(path)
    return path.parent if (path.parent / "config.yaml").is_file() else path


def old_store_line(path: str | os.PathLike, what: str) -> str:
    """The one line a reader of a store of an older format raises (:class:`OldStore`, and the run-level checks of
    ``pipelines.upgrade.store``): the store, what is old, the fix."""
    return (f"trajectory store {path} is of an older format ({what}): rewrite it once with "
            f"`python -m pipelines.upgrade {upgrade_target(path)}`")


def old_parts(group: zarr.Group) -> list[str]:
    """What is of an older format in an opened store group (its schema version read): schema version 1 (the
    per-step group named ``epochs``), no ``steps/attempt`` / ``steps/shard_attempt``, no ``store_id``; [] when
    current."""
    if group.attrs["schema_version"] == 1:
        return ["schema version 1"]
    steps = group[_STEPS_GROUP] if _STEPS_GROUP in group else {}
    out = [f"no {_STEPS_GROUP}/{n} array" for n in (_ATTEMPT, _SHARD_ATTEMPT) if n not in steps]
    return out + ([] if group.attrs.get("store_id") else ["no store_id attribute"])


class StoreGone(FileNotFoundError):
    """The store's directory (its ``zarr.json``) vanished under a writer: it was removed while the run wrote."""


def _check_present(path: str | os.PathLike) -> None:
    """Raise :class:`StoreGone` unless ``path`` still holds the store's group metadata: checked before each driver
    and worker write, since zarr's local store makes every missing parent directory of a chunk it writes (a store
    removed under a running run came back piece by piece)."""
    if not os.path.isfile(os.path.join(os.fspath(path), "zarr.json")):
        raise StoreGone(f"trajectory store {path} was removed while it was written to; nothing is re-created")


def _why(exc: BaseException) -> str:
    """`Type: message` of an exception on one line (at most 200 characters of the message)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


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
    try:
        group = zarr.open_group(str(path), mode=mode)
        group.attrs.asdict()
    except Exception as exc:  # noqa: BLE001 - json/metadata errors of a truncated or garbled zarr.json
        raise DamagedStore(f"trajectory store {path} is damaged: its group metadata ({path / 'zarr.json'}) cannot "
                           f"be read ({_why(exc)}); its data cannot be trusted: re-record it, or restore it from a "
                           f"whole copy") from None
    version = group.attrs.get("schema_version")
    if version is None or "layout" not in group.attrs:
        raise ValueError(f"{path} is a zarr group but not a dagrl trajectory store (no schema_version/layout attrs)")
    if version not in (1, SCHEMA_VERSION):
        raise ValueError(
            f"trajectory store at {path} has schema_version {version}, this dagrl reads version {SCHEMA_VERSION}; "
            f"read it with a matching dagrl version or start a new run directory"
        )
    old = old_parts(group)
    if old:
        raise OldStore(old_store_line(path, ", ".join(old)))
    return group


class TrajectoryStore:
    """Driver-side handle on one run's trajectory store. Use :meth:`create` or :meth:`open`."""

    def __init__(self, path: str | os.PathLike, group: zarr.Group):
        self._path = Path(path)
        self._group = group
        self._steps = _STEPS_GROUP
        attrs = group.attrs.asdict()
        layout = attrs["layout"]
        self._T = int(layout["T"])
        self._num_envs = int(layout["num_envs"])
        self._shard_size = int(layout["shard_size"])
        self._fields = {name: FieldSpec.from_json(d) for name, d in layout["fields"].items()}
        self._growing: list[zarr.Array] | None = None  # reserve()'s array handles, opened once (driver only)

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
        """Create a store with ``N = 0`` steps, or reopen an identical one at ``path`` (resume).

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
            return cls(path, group)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ValueError(f"{path} exists and is not an empty directory nor a trajectory store; pick another path")

        group = zarr.open_group(str(path), mode="w-")
        group.attrs.update({
            "schema_version": SCHEMA_VERSION,
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "store_id": uuid.uuid4().hex,  # this recording's identity (`fingerprint`)
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
                compressors=_FIELD_COMPRESSORS,
                config=_ARRAY_CONFIG,
            )
        eg = group.create_group(_STEPS_GROUP)
        eg.create_array(_COMPLETE, shape=(0,), chunks=(_STEP_CHUNK,), dtype="bool", fill_value=False)
        eg.create_array(_ATTEMPT, shape=(0,), chunks=(_STEP_CHUNK,), dtype="int64", fill_value=0)
        eg.create_array(_SHARD_ATTEMPT, shape=(0, num_envs // shard_size), chunks=(1, 1), dtype="int64",
                        fill_value=-1, config=_ARRAY_CONFIG)
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
    def num_steps(self) -> int:
        """Allocated training steps ``N`` (complete or not)."""
        return int(self._step_array(_COMPLETE).shape[0])

    @property
    def attrs(self) -> dict[str, Any]:
        return zarr.open_group(str(self._path), mode="r").attrs.asdict()

    @property
    def step_scalar_names(self) -> list[str]:
        return sorted(n for n in self._group[self._steps].array_keys() if n not in _BOOKKEEPING)

    # ---- driver-side writes ----------------------------------------------------------------------------
    def update_attrs(self, **attrs: Any) -> None:
        """Add or replace caller attributes (JSON-serialisable; reserved names raise ValueError)."""
        _check_json_attrs(attrs)
        self._group.attrs.update(attrs)

    def reserve(self, step: int) -> int:
        """Start a new attempt at writing ``step``: grow ``N`` so that ``N >= step + 1`` (never shrinks), bump
        ``attempt[step]`` and clear ``complete[step]`` (a redone step is not shown until every shard of
        the new attempt is written). Writes no field data. Driver only.

        Returns:
            the step's new attempt id (int >= 1); :func:`write_shard` records it per shard.
        Raises:
            ValueError: a negative step.
            StoreGone: the store's directory was removed (nothing is re-created).
        """
        _check_present(self._path)
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        need = step + 1
        arrays = self._growing_arrays()
        if need > arrays[-1].shape[0]:
            for arr in arrays:  # `complete` last: it defines N
                if arr.shape[0] < need:
                    arr.resize((need, *arr.shape[1:]))  # zarr 3: updates this handle's shape too
        arrays[-1][step] = False  # first: a reader never sees the step complete mid-attempt
        att = self._step_array(_ATTEMPT)
        new = int(att[step]) + 1
        att[step] = new
        return new

    def _growing_arrays(self) -> list:
        """Every array `reserve` grows, `complete` last: handles opened once per store handle (re-opening ~20
        arrays at every step cost the driver ~14 of reserve's ~36 ms per training step in zarr 3). Only the driver
        grows a store, through this handle, so the handles' shapes stay current; `mark_complete` drops them when it
        adds a per-step scalar."""
        if self._growing is None:
            steps = self._group[self._steps]
            self._growing = [self._field_array(n) for n in self._fields] + [
                self._step_array(n) for n in [*self.step_scalar_names, _SHARD_ATTEMPT, _ATTEMPT, _COMPLETE]
                if n in steps]
        return self._growing

    def attempt(self, step: int) -> int:
        """The latest attempt id of ``step`` (0: never reserved)."""
        return int(self._step_array(_ATTEMPT)[int(step)])

    def invalidate_from(self, step: int) -> list[int]:
        """A rollback or resume to training step ``step``: steps ``>= step`` stop being complete (their data
        belongs to a superseded timeline and is shown again only once redone). Driver only.

        Returns:
            the steps that were complete and are not any more.
        """
        step = max(0, int(step))
        E = self.num_steps
        if step >= E:
            return []
        done = self._step_array(_COMPLETE)
        was = np.flatnonzero(done[step:E]) + step
        if was.size:
            done[step:E] = False
        return [int(e) for e in was]

    def shards_written(self, step: int) -> np.ndarray:
        """Bool ``[S]``: whether each shard has written the latest attempt of ``step``."""
        step = int(step)
        return self._step_array(_SHARD_ATTEMPT)[step] == self._step_array(_ATTEMPT)[step]

    def mark_complete(self, step: int, **per_step_scalars: Any) -> None:
        """Record per-step scalars (e.g. ``weight_version``, ``global_step``) and set ``complete[step]``.

        Raises:
            ValueError: the step is not allocated, or a shard has not written the step's latest attempt (the
                message names the shards and the attempts they hold).
            StoreGone: the store's directory was removed (nothing is re-created).
        """
        _check_present(self._path)
        step = int(step)
        E = self.num_steps
        if not 0 <= step < E:
            raise ValueError(f"step {step} is not allocated in {self._path} (N={E}); call reserve({step}) first")
        written = self.shards_written(step)
        if not written.all():
            held = self._step_array(_SHARD_ATTEMPT)[step]
            missing = np.flatnonzero(~written).tolist()
            raise ValueError(f"step {step} of {self._path}: shard(s) {missing} have not written its latest attempt "
                             f"{self.attempt(step)} (they hold attempt(s) {held[missing].tolist()}, -1 = never); "
                             f"it cannot be marked complete")
        eg = self._group[self._steps]
        for name, value in per_step_scalars.items():
            if name in _BOOKKEEPING or "/" in name:
                raise ValueError(f"per-step scalar name {name!r} is reserved or invalid")
            value = np.asarray(value)
            if value.ndim != 0:
                raise ValueError(f"per-step scalar {name!r} must be a scalar, got shape {value.shape}")
            if name not in eg:
                if value.dtype.kind == "b":
                    dtype, fill = "bool", False
                elif value.dtype.kind in "iu":
                    dtype, fill = "int64", -1
                elif value.dtype.kind == "f":
                    dtype, fill = "float64", math.nan
                else:
                    raise ValueError(f"per-step scalar {name!r} must be bool/int/float, got {value.dtype}")
                eg.create_array(name, shape=(E,), chunks=(_STEP_CHUNK,), dtype=dtype, fill_value=fill)
                self._growing = None  # reserve() must grow the new array too
            arr = self._step_array(name)
            cast = value.astype(arr.dtype)
            if arr.dtype.kind != "f" and cast.item() != value.item():
                raise ValueError(f"per-step scalar {name!r}={value.item()!r} does not fit stored dtype {arr.dtype}")
            arr[step] = cast
        self._step_array(_COMPLETE)[step] = True

    # ---- reads -----------------------------------------------------------------------------------------
    def complete_steps(self) -> np.ndarray:
        """Steps whose latest attempt is whole: ``complete[n]`` set and every shard wrote ``attempt[n]``.
        int64 ``[n]``, ascending. The one list every reader of a store's data should use."""
        done = self._step_array(_COMPLETE)[:]
        if done.any():
            whole = (self._step_array(_SHARD_ATTEMPT)[:] == self._step_array(_ATTEMPT)[:][:, None]).all(axis=1)
            done &= whole[:done.shape[0]]
        return np.flatnonzero(done).astype(np.int64)

    def step_scalar(self, name: str) -> np.ndarray:
        """Per-step scalar array ``[N]`` (int fill -1, float fill NaN where never set)."""
        if name not in _BOOKKEEPING and name not in self.step_scalar_names:
            raise KeyError(f"no per-step scalar {name!r} in {self._path}; known: {self.step_scalar_names}")
        return self._step_array(name)[:]

    def to_dask(self, field: str):
        """Lazy ``[N, T, B, ...]`` dask array, one dask chunk per zarr chunk (step x shard).

        The chunk files of the complete steps are checked (stat only) when it is built, as :meth:`read` does; a
        chunk that exists but cannot be decoded fails at compute time with zarr's error. Steps that are not
        complete are not vouched for (fill values where nothing was written).

        Raises:
            DamagedStore: a complete step's chunk file of ``field`` missing, or its array metadata unreadable.
            KeyError: ``field`` not in the store's layout.
        """
        import dask.array as da

        arr = self._verified_array(field)
        self._check_chunks(field, arr, self._complete_for_check(), "complete")
        return da.from_zarr(arr)

    def read(self, field: str, steps: Iterable[int] | None = None) -> np.ndarray:
        """``field`` at training ``steps`` (int, in the given order), ``[len(steps), T, B, *shape]`` in the field's
        dtype; ``steps`` None: every allocated step, ``[N, T, B, *shape]``. THE verified read of a store's data:
        before any data is returned, every chunk file it needs is checked to exist (a stat per (step, shard); a
        missing one would read as zeros), for ``steps`` None those of the complete steps (steps not complete are
        returned as they are: fill values where nothing was written); a chunk that cannot be decoded is named too.
        Readers pass complete steps (:meth:`complete_steps`).

        Raises:
            DamagedStore: a needed chunk file missing or undecodable, or the field's array metadata missing or
                unreadable: one line naming the store, ``fields/<field>``, the chunk file, its step and envs, and the
                fix (re-record or restore).
            IndexError: a step outside ``[0, N)``. KeyError: ``field`` not in the store's layout.
        """
        arr = self._verified_array(field)
        if steps is None:
            check, state, sel = self._complete_for_check(), "complete", None
        else:
            sel = np.asarray(list(steps), dtype=np.int64)
            if sel.size and (sel.min() < 0 or sel.max() >= arr.shape[0]):
                raise IndexError(f"steps {sel.tolist()} out of range for N={arr.shape[0]} in {self._path}")
            check, state = sel, "read"
        self._check_chunks(field, arr, check, state)
        try:
            return arr[:] if sel is None else arr.oindex[sel]
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - codec/IO errors of a garbled chunk file: name the file
            asked = sorted({int(n) for n in (range(arr.shape[0]) if sel is None else sel)})
            self._check_chunks(field, arr, asked, state, decode=True)  # raises DamagedStore naming the chunk
            raise self._damaged(f"{_FIELDS_GROUP}/{field} at steps {_ranges(np.asarray(asked))} cannot be read "
                                f"({_why(exc)})") from None

    def gather(self, field: str, rows: np.ndarray) -> np.ndarray:
        """``field`` at the ``(step, t, b)`` rows (int ``[M, 3]``): ``[M, *shape]`` in the rows' order, in the
        field's dtype. Read one step at a time through :meth:`read` (verified), so the peak is the result plus one
        step's field.

        Raises:
            DamagedStore, IndexError, KeyError: as :meth:`read`.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        if field not in self._fields:
            self._verified_array(field)  # the KeyError naming the known fields
        spec = self._fields[field]
        out = np.empty((len(rows), *spec.shape), spec.dtype)
        for n in np.unique(rows[:, 0]):
            sel = np.flatnonzero(rows[:, 0] == n)
            out[sel] = self.read(field, [int(n)])[0][rows[sel, 1], rows[sel, 2]]
        return out

    def check_files(self, fields: Iterable[str] | None = None, steps: Iterable[int] | None = None, *,
                    decode: bool = False) -> None:
        """Check that the files behind ``fields`` (default: every field) at ``steps`` (default: the complete steps)
        are whole, so that a read of them returns what the run wrote: each field's array metadata opens, and the
        chunk file of every (step, shard) exists. Every shard write stores all its chunks, fill values included
        (``write_empty_chunks``, since the first schema), so a chunk file missing from a complete step is damage
        done after the run wrote it (a deleted or half-copied file) that zarr would read back silently as the
        fill value (zeros, False). Steps passed explicitly are checked as given: pass only steps that were
        written. With ``decode``, each of those chunks is also read and decoded (reads the data: for locating
        the damage after a read failed, not for every open of a large store). :meth:`read` runs the same check
        (without ``decode``) on every read; this is the check alone (a config check before a run starts).

        Raises:
            DamagedStore: one line naming the store, the array (``fields/<name>``, or the step bookkeeping), the
                chunk file with its step and envs where known, what is wrong, and the fix (re-record or restore).
            KeyError: a field name not in the store's layout (names the known fields).
        """
        names = list(self._fields) if fields is None else list(fields)
        unknown = [n for n in names if n not in self._fields]
        if unknown:
            raise KeyError(f"no field {unknown[0]!r} in {self._path}; known fields: {sorted(self._fields)}")
        state = "written" if steps is not None else "complete"
        steps = self._complete_for_check() if steps is None else steps
        for name in names:
            self._check_chunks(name, self._verified_array(name), steps, state, decode=decode)

    def fingerprint(self) -> str:
        """The identity of the data a reader of this store gets, without reading field data: one line
        ``store <store_id[:12]> (created <created_at>), <k> complete steps, digest <sha256[:16]>``. The digest covers the store id,
        the creation time, the layout, the complete steps with their attempt ids and the caller attributes (a
        recording's episode index among them): a store re-recorded at the same path, a step added, redone or
        invalidated, gives another fingerprint; the same files copied elsewhere give the same one.

        Raises:
            DamagedStore: the step bookkeeping cannot be read.
        """
        attrs = self.attrs
        done = self._complete_for_check()
        attempts = self._step_array(_ATTEMPT)[:][done].tolist() if len(done) else []
        user = {k: v for k, v in attrs.items() if k not in _RESERVED_ATTRS}
        blob = json.dumps({"store_id": attrs.get("store_id"), "created_at": attrs.get("created_at"),
                           "schema_version": attrs.get("schema_version"), "layout": attrs.get("layout"),
                           "complete": [int(n) for n in done], "attempts": attempts, "attrs": user},
                          sort_keys=True, default=str)
        digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
        return (f"store {str(attrs['store_id'])[:12]} (created {attrs.get('created_at')}), {len(done)} complete "
                f"steps, digest {digest}")

    def _complete_for_check(self) -> np.ndarray:
        """:meth:`complete_steps`, a damaged step bookkeeping raised as DamagedStore."""
        try:
            return self.complete_steps()
        except Exception as exc:  # noqa: BLE001 - zarr/numcodecs/json errors of damaged bookkeeping files
            raise self._damaged(f"its step bookkeeping ({self._steps}/{_COMPLETE}, {_ATTEMPT}, "
                                f"{_SHARD_ATTEMPT}) cannot be read ({_why(exc)})") from None

    def _verified_array(self, name: str) -> zarr.Array:
        """The zarr array of field ``name``, its metadata checked against the layout.

        Raises:
            KeyError: not a field of the layout. DamagedStore: metadata missing, unreadable or of another shape.
        """
        if name not in self._fields:
            raise KeyError(f"no field {name!r} in {self._path}; known fields: {sorted(self._fields)}")
        key = f"{_FIELDS_GROUP}/{name}"
        try:
            arr = self._group[key]
        except Exception as exc:  # noqa: BLE001 - KeyError (no zarr.json), json/metadata errors
            raise self._damaged(f"{key}: its array metadata ({key}/zarr.json) is missing or unreadable "
                                f"({_why(exc)})") from None
        if not isinstance(arr, zarr.Array) or arr.ndim != 3 + len(self._fields[name].shape):
            raise self._damaged(f"{key}: its array metadata ({key}/zarr.json) does not describe the field "
                                f"[N, T, B, *{list(self._fields[name].shape)}] of the store's layout")
        return arr

    def _check_chunks(self, name: str, arr: zarr.Array, steps: Iterable[int], state: str, *,
                      decode: bool = False) -> None:
        """Stat (and with ``decode`` read) the chunk file of every (step, shard) of field ``name`` at ``steps``;
        ``state`` says why they must exist ("complete", "written", "read"). Raises DamagedStore (check_files)."""
        key = f"{_FIELDS_GROUP}/{name}"
        steps = sorted({int(n) for n in steps})
        if not steps or 0 in arr.shape[1:]:  # a field with a zero-size dim has no chunk files
            return
        if steps[-1] >= arr.shape[0]:
            raise self._damaged(f"{key}: holds {arr.shape[0]} steps, step {steps[-1]} is {state}")
        S, tail = self._shard_size, (0,) * (arr.ndim - 3)
        missing = []
        for n in steps:
            for s in range(self.num_shards):
                chunk = arr.metadata.encode_chunk_key((n, 0, s) + tail)
                envs = f"env {s}" if S == 1 else f"envs {s * S}-{(s + 1) * S - 1}"
                where = f"{key} chunk file {chunk} (step {n}, {envs})"
                if not os.path.isfile(os.path.join(self._path, key, chunk)):
                    missing.append(where)
                elif decode and not missing:
                    try:
                        arr[n, :, s * S:(s + 1) * S]
                    except Exception as exc:  # noqa: BLE001 - codec errors of a garbled chunk file
                        raise self._damaged(f"{where} cannot be decoded ({_why(exc)})") from None
        if missing:
            fill = "False" if arr.dtype == np.bool_ else "zeros"
            more = f" (and {len(missing) - 1} more chunk files of {key})" if len(missing) > 1 else ""
            why = "" if state == "read" else f", though the step is {state}"
            raise self._damaged(f"{missing[0]} is missing{more}{why} (zarr would read it as {fill})")

    # ---- helpers ---------------------------------------------------------------------------------------
    def _damaged(self, what: str) -> DamagedStore:
        return DamagedStore(f"trajectory store {self._path} is damaged: {what}; its data cannot be trusted: "
                            "re-record it, or restore it from a whole copy")

    def _field_array(self, name: str) -> zarr.Array:
        if name not in self._fields:
            raise KeyError(f"no field {name!r} in {self._path}; known fields: {sorted(self._fields)}")
        return self._group[f"{_FIELDS_GROUP}/{name}"]

    def _step_array(self, name: str) -> zarr.Array:
        return self._group[f"{self._steps}/{name}"]

    def __repr__(self) -> str:
        return (f"TrajectoryStore({str(self._path)!r}, N={self.num_steps}, T={self._T}, B={self._num_envs}, "
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
    attempt: zarr.Array  # steps/attempt
    shard_attempt: zarr.Array  # steps/shard_attempt


_CACHE: dict[str, _Opened] = {}
_CACHE_LOCK = threading.Lock()


def _open_for_write(path: str) -> _Opened:
    group = _open_group(Path(path))
    layout = group.attrs["layout"]
    fields = {name: FieldSpec.from_json(d) for name, d in layout["fields"].items()}
    arrays = {name: group[f"{_FIELDS_GROUP}/{name}"].with_config(_ARRAY_CONFIG) for name in fields}
    eg = group[_STEPS_GROUP]
    att, sha = eg[_ATTEMPT], eg[_SHARD_ATTEMPT].with_config(_ARRAY_CONFIG)
    E = min([a.shape[0] for a in arrays.values()] + [att.shape[0], sha.shape[0]])
    return _Opened(E, int(layout["T"]), int(layout["num_envs"]), int(layout["shard_size"]), fields, arrays, att, sha)


def clear_cache() -> None:
    """Forget the per-process cache of stores opened by :func:`write_shard`."""
    with _CACHE_LOCK:
        _CACHE.clear()


def write_shard(path: str, *, step: int, shard: int, data: Mapping[str, np.ndarray],
                attempt: int | None = None) -> dict[str, float]:
    """Write one env shard of one step: region ``[step, :, shard*S:(shard+1)*S]`` of every field, then record
    in ``steps/shard_attempt[step, shard]`` the attempt it belongs to.

    Runs inside Dask tasks. ``data[name]`` must be ``[T, shard_size, *spec.shape]`` with the field's exact
    dtype (no casting). The step must have been reserved by the driver. ``attempt``: the id
    :meth:`TrajectoryStore.reserve` returned for this write (None: the step's latest attempt when the write
    starts). Returns ``{"bytes", "seconds"}`` (bytes = uncompressed payload). Raises :class:`StoreGone` when the
    store's directory was removed (zarr's local store would make the chunk files' directories again).
    """
    t0 = time.perf_counter()
    key = os.path.abspath(os.fspath(path))
    _check_present(key)
    step, shard = int(step), int(shard)
    with _CACHE_LOCK:
        opened = _CACHE.get(key)
    if opened is None or step >= opened.E:
        opened = _open_for_write(key)
        with _CACHE_LOCK:
            _CACHE[key] = opened
    if not 0 <= step < opened.E:
        raise ValueError(f"step {step} is not allocated in {key} (N={opened.E}); "
                         "the driver must call TrajectoryStore.reserve(step) before the shard writes")
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
    if attempt is None:
        attempt = int(opened.attempt[step])
    lo, hi = shard * opened.shard_size, (shard + 1) * opened.shard_size
    nbytes = 0
    for name, value in arrays.items():
        opened.arrays[name][step, :, lo:hi] = value
        nbytes += value.nbytes
    opened.shard_attempt[step, shard] = int(attempt)  # last: the shard counts as written only once its data is
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
    """Short human summary: layout, fields with shapes and dtypes, complete steps, attributes."""
    store = TrajectoryStore.open(path)
    E = store.num_steps
    done = store.complete_steps()
    attrs = store.attrs
    lines = [
        f"trajectory store {store.path} (schema {attrs['schema_version']}, created {attrs.get('created_at')})",
        f"  T={store.T} num_envs={store.num_envs} shard_size={store.shard_size} ({store.num_shards} shards)",
        f"  steps allocated={E} complete={done.size}: {_ranges(done)}",
        "  fields:",
    ]
    width = max(len(n) for n in store.fields)
    for name, spec in store.fields.items():
        dims = ", ".join(str(d) for d in (E, store.T, store.num_envs, *spec.shape))
        lines.append(f"    {name:<{width}}  [{dims}] {spec.dtype}")
    if store.step_scalar_names:
        lines.append(f"  per-step: {', '.join(store.step_scalar_names)}")
    user = {k: v for k, v in attrs.items() if k not in _RESERVED_ATTRS}
    for k, v in user.items():
        text = json.dumps(v)
        lines.append(f"  {k} = {text if len(text) <= 80 else text[:77] + '...'}")
    return "\n".join(lines)
