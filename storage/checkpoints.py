"""Atomic checkpoints: ``<run_dir>/checkpoints/global_step_<N>/``.

Layout of one checkpoint::

    global_step_<N>/
      <key>.pt      one per top-level key whose value does not survive a JSON round trip exactly (state dicts,
                    RNG states, tuples, ...): torch.save, loaded back with ``torch.load(weights_only=True)``
      meta.json     the top-level values that survive a JSON round trip exactly (step counters, cursors, ...)
      index.json    written last: step, files with size and sha256, and which file (and kind) holds each key

Writing goes to a hidden temp dir in ``checkpoints/`` (files fsynced), then ``os.rename`` into place; an existing
``global_step_<N>`` is first renamed aside and removed only after the new one is in place. A directory without a
readable ``index.json`` or whose files do not match it is incomplete and ignored by :func:`latest_checkpoint`.

The best checkpoint (:func:`mark_best`): ``checkpoints/best.json`` names its step and ``checkpoints/best`` links to
it (both replaced atomically); :func:`prune_checkpoints` keeps it besides the newest ``keep``; :func:`sync_best`
re-points or removes it after a resume or rollback.

Only what can be loaded back is written: :func:`save_checkpoint` refuses, before writing anything, a value that
``torch.load(weights_only=True)`` would not load (a numpy array, a numpy RNG state tuple, a custom object), naming
its key path (``rng.numpy[1]``).

Format: ``index.json`` carries ``"format": FORMAT``. A checkpoint of an older format (no ``format``: pickled
``<key>.pkl.pt`` values, torch-only RNG states, integer-keyed optimizer states) is refused where it is verified or
loaded (:class:`OldFormat`, one line naming its index and the fix): ``python -m pipelines.upgrade RUN_DIR`` rewrites
the run directory once into today's format.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS_DIR = "checkpoints"
INDEX_FILE = "index.json"
META_FILE = "meta.json"
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_RESERVED_KEYS = {"meta", "index"}
FORMAT = 2  # index.json's "format": 2 = weights-only torch values, THE actor state (tasks.actor.state); none = 1


class OldFormat(ValueError):
    """A checkpoint written in an older format (module docstring); the message names its index and the fix."""


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


_PLAIN = (str, int, float, bool, type(None), bytes)


def _leaf_loads(value: Any) -> bool:
    """Whether torch.load(weights_only=True) loads a non-container leaf back (torch.dtype, torch.Size, ...)."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)
    except Exception:  # noqa: BLE001 - UnpicklingError and friends: not loadable
        return False
    return type(back) is type(value)


def check_loadable(value: Any, path: str = "") -> None:
    """Raise ValueError naming the first key path (``rng.numpy[1]``) whose value ``torch.load(weights_only=True)``
    cannot load back. Containers: dict (str/int keys), list, tuple; leaves: tensors, str/int/float/bool/None/bytes,
    and whatever else the weights-only unpickler accepts (torch.dtype, torch.Size, ...)."""
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise ValueError(f"checkpoint value {path} is a {type(value).__name__} (a tensor subclass): save "
                             f"a plain tensor (.detach().clone() of its data)")
        return
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, Mapping):
        if not isinstance(value, (dict,)):
            raise ValueError(f"checkpoint value {path} is a {type(value).__name__}: save a plain dict (dict(x))")
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise ValueError(f"checkpoint value {path} has a key {k!r} of type {type(k).__name__}: use str or "
                                 f"int keys")
            check_loadable(v, f"{path}.{k}" if path else str(k))
        return
    if type(value) in (list, tuple):
        for i, v in enumerate(value):
            check_loadable(v, f"{path}[{i}]")
        return
    if not _leaf_loads(value):
        hint = ("convert it: torch.from_numpy(a) or a.tolist() for an array, int(x)/float(x) for a numpy "
                "scalar, tasks.actor.state.rng_state() for RNG states") if type(value).__module__ == "numpy" \
            else "convert it to tensors, lists, dicts and plain scalars"
        raise ValueError(f"checkpoint value {path} ({type(value).__module__}.{type(value).__qualname__}) cannot "
                         f"be loaded back by torch.load(weights_only=True): {hint}")


def _json_roundtrips(value: Any) -> bool:
    try:
        return json.loads(json.dumps(value, allow_nan=False)) == value
    except (TypeError, ValueError):
        return False


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"global_step_{int(step)}"


def checkpoint_step(path: str | os.PathLike) -> int:
    m = _STEP_RE.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a checkpoint directory (expected a name global_step_<N>)")
    return int(m.group(1))


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: Mapping[str, Any], *,
                    create_run_dir: bool = True) -> Path:
    """Write ``state`` atomically to ``<run_dir>/checkpoints/global_step_<step>/`` and return that path.
    ``create_run_dir=False`` (a running run's checkpoints): ``run_dir`` must exist and is never made again
    (``storage.rundir.make_dir_in``), so a run directory removed under its run is not re-created by a checkpoint.

    Raises:
        storage.rundir.RunDirGone: ``create_run_dir=False`` and ``run_dir`` is not there.
        ValueError: a negative step, a key that is not file-name safe, or a value that could not be loaded back
            (:func:`check_loadable`: the message names its key path) - all before anything is written.
    """
    step = int(step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    for key in state:
        if not isinstance(key, str) or not _KEY_RE.match(key) or key in _RESERVED_KEYS:
            raise ValueError(f"checkpoint key {key!r} must be a file-name-safe str ([A-Za-z0-9_.-]) and not "
                             f"one of {sorted(_RESERVED_KEYS)}")
    json_keys = {key for key, value in state.items() if not _has_tensor(value) and _json_roundtrips(value)}
    for key, value in state.items():  # refused before anything is written
        if key not in json_keys:
            check_loadable(value, key)
    if create_run_dir:
        parent = Path(run_dir) / CHECKPOINTS_DIR
        parent.mkdir(parents=True, exist_ok=True)
    else:
        from storage.rundir import make_dir_in
        parent = make_dir_in(run_dir, CHECKPOINTS_DIR)
    final = parent / f"global_step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-global_step_{step}-", dir=parent))
    old = None
    try:
        keys: dict[str, dict[str, str]] = {}
        meta: dict[str, Any] = {}
        for key, value in state.items():
            if key in json_keys:
                meta[key] = value
                keys[key] = {"file": META_FILE, "kind": "json"}
                continue
            keys[key] = {"file": f"{key}.pt", "kind": "torch"}
            _write_file(tmp / keys[key]["file"], lambda f, v=value: torch.save(v, f))
        if meta:
            _write_file(tmp / META_FILE, lambda f: f.write(json.dumps(meta, indent=1, sort_keys=True).encode()))
        files = {
            p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(tmp.iterdir())
        }
        index = {
            "format": FORMAT,
            "step": step,
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "keys": keys,
            "files": files,
        }
        _write_file(tmp / INDEX_FILE, lambda f: f.write(json.dumps(index, indent=1, sort_keys=True).encode()))
        _fsync_dir(tmp)

        if final.exists():
            old = parent / f".old-global_step_{step}-{tmp.name.rsplit('-', 1)[-1]}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(parent)
    except BaseException:
        if old is not None and not final.exists():
            os.rename(old, final)  # put the previous checkpoint back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _read_index(path: Path) -> dict[str, Any]:
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise ValueError(f"checkpoint {path} is incomplete: {index_path} is missing")
    try:
        index = json.loads(index_path.read_text())
        index["files"], index["keys"]  # noqa: B018 - shape check
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint index {index_path} is unreadable: {e}") from None
    return index


def played_policy_key(path: str | os.PathLike) -> str:
    """The key of the weights a checkpoint's evals played: ``policy_ema`` (the actor's average, written with
    `algorithm.ema_decay` > 0) when the checkpoint has one, else ``policy``. An unreadable index gives
    ``policy`` (loading or verifying then names the damage)."""
    try:
        return "policy_ema" if "policy_ema" in _read_index(Path(path))["keys"] else "policy"
    except (ValueError, OSError, TypeError):
        return "policy"


def _is_complete(path: Path) -> bool:
    """Cheap check (no hashing): index readable and every listed file present with its size."""
    try:
        index = _read_index(path)
        return all((path / name).is_file() and (path / name).stat().st_size == info["size"]
                   for name, info in index["files"].items())
    except (ValueError, OSError, KeyError, TypeError):
        return False


def check_format(path: str | os.PathLike, index: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`OldFormat` when the checkpoint at `path` (its index, read unless given) is of an older format
    than :data:`FORMAT`: one line naming the index and the fix (``python -m pipelines.upgrade RUN_DIR``)."""
    path = Path(path)
    index = _read_index(path) if index is None else index
    if index.get("format") != FORMAT:
        run_dir = path.parent.parent
        raise OldFormat(f"checkpoint {path / INDEX_FILE} is of an older format ({index.get('format', 1)}, today "
                        f"{FORMAT}): rewrite its run once with `python -m pipelines.upgrade {run_dir}`")


def _index_for(path: Path, keys: tuple[str, ...] | None) -> dict[str, Any]:
    """The checkpoint's index (of today's format: :func:`check_format`), narrowed to the entries and files of
    `keys` (None: all)."""
    index = _read_index(path)
    check_format(path, index)
    if keys is not None:
        missing = [k for k in keys if k not in index["keys"]]
        if missing:
            raise KeyError(f"checkpoint {path} has no key(s) {missing}; it has {sorted(index['keys'])}")
        index = {**index, "keys": {k: index["keys"][k] for k in keys}}
        wanted = {e["file"] for e in index["keys"].values()}
        index["files"] = {n: i for n, i in index["files"].items() if n in wanted}
    return index


def _verify_files(path: Path, files: Mapping[str, Any], index_name: str = INDEX_FILE) -> None:
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"checkpoint {path}: file {name} listed in {index_name} is missing")
        if f.stat().st_size != info["size"]:
            raise ValueError(f"checkpoint {path}: file {name} has {f.stat().st_size} bytes, {index_name} says "
                             f"{info['size']}")
        if _sha256(f) != info["sha256"]:
            raise ValueError(f"checkpoint {path}: file {name} is corrupt (sha256 differs from {index_name})")


def verify_checkpoint(path: str | os.PathLike, keys: tuple[str, ...] | None = None) -> None:
    """Check the files of a checkpoint against its index (presence, size, sha256) without loading anything: all
    of them, or those holding `keys` (as :func:`load_checkpoint`'s `keys`).

    Drivers call it before they start a cluster or write anything for a checkpoint they will load later (resume,
    record's teacher, eval), so that a damaged file is one clear error up front, not a worker traceback after the
    run has begun. Costs one read of every file (sha256 at ~1 GB/s).

    Raises:
        FileNotFoundError: no directory at `path`.
        ValueError: index missing or unreadable, or a file missing, of another size or with another sha256
            (the message names the file); :class:`OldFormat` for a checkpoint of an older format.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    _verify_files(path, _index_for(path, keys)["files"])


def checkpoint_damage(path: str | os.PathLike, keys: tuple[str, ...] | None = None) -> str | None:
    """:func:`verify_checkpoint` as one line for an error message (whitespace collapsed), or None when the files
    (of `keys`; None: all) are intact. A checkpoint without one of `keys` counts as intact here: loading it names
    the missing key."""
    try:
        verify_checkpoint(path, keys)
    except KeyError:
        return None
    except (OSError, ValueError) as exc:
        return " ".join(str(exc).split())
    return None


def intact_before(run_dir: str | os.PathLike, step: int) -> Path | None:
    """The newest complete checkpoint of `run_dir` below `step` whose files all verify (:func:`verify_checkpoint`),
    or None: what a resume could start from when the newest checkpoint is damaged."""
    for p in reversed(list_checkpoints(run_dir)):
        if checkpoint_step(p) < step:
            try:
                verify_checkpoint(p)
                return p
            except (OSError, ValueError):
                continue
    return None


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu",
                    keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`, verifying sizes and sha256 of the files read first.

    Args:
        keys: load only these top-level keys (e.g. ``("run",)`` for the runner meta without the weights);
            None: all. A key the checkpoint lacks raises KeyError naming the keys it has.

    Raises:
        FileNotFoundError: no directory at `path`.
        OldFormat: a checkpoint of an older format (:func:`check_format`: the fix is ``pipelines.upgrade``).
        ValueError: a damaged checkpoint (:func:`verify_checkpoint`).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    index = _index_for(path, keys)
    _verify_files(path, index["files"])
    meta = json.loads((path / META_FILE).read_text()) if META_FILE in index["files"] else {}
    state: dict[str, Any] = {}
    for key, entry in index["keys"].items():
        if entry["kind"] == "json":
            state[key] = meta[key]
        else:
            state[key] = torch.load(path / entry["file"], map_location=map_location, weights_only=True)
    return state


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of ``run_dir``, oldest step first (temp and incomplete dirs are ignored)."""
    parent = Path(run_dir) / CHECKPOINTS_DIR
    if not parent.is_dir():
        return []
    found = [p for p in parent.iterdir() if p.is_dir() and _STEP_RE.match(p.name) and _is_complete(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest complete checkpoints, never the best one (:func:`best_checkpoint`: it
    is kept in addition to the ``keep`` newest); returns the removed paths, oldest first."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    found = list_checkpoints(run_dir)
    best = best_checkpoint(run_dir)
    doomed = [p for p in (found[:-keep] if keep else found) if best is None or p.name != best.name]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


# ----- the best checkpoint: a pointer file and a `best` link in checkpoints/ -----
BEST_FILE = "best.json"  # {"step": N, "checkpoint": "global_step_N", "metric": ..., "value": ...}
BEST_LINK = "best"  # a relative symlink to global_step_N: <run_dir>/checkpoints/best/hf is the best hf dir


def _replace_atomically(parent: Path, name: str, make) -> None:
    """Create ``parent/name`` by `make(tmp_path)` on a hidden temp name, then ``os.replace`` it into place."""
    tmp = parent / f".tmp-{name}-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        make(tmp)
        os.replace(tmp, parent / name)
    except BaseException:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        raise
    _fsync_dir(parent)


def mark_best(run_dir: str | os.PathLike, step: int, value: float, metric: str = "eval/success_once") -> Path:
    """Mark the complete checkpoint of ``step`` as the run's best: write ``checkpoints/best.json`` and point the
    link ``checkpoints/best`` at ``global_step_<step>``, each atomically (temp name, fsync, ``os.replace``: a
    reader sees the old pointer or the new one, never a partial file). :func:`prune_checkpoints` never removes
    it. Returns the checkpoint's path.

    Raises:
        ValueError: no complete checkpoint of ``step`` exists (the pointer is left as it was).
    """
    step = int(step)
    path = checkpoint_dir(run_dir, step)
    if not _is_complete(path):
        raise ValueError(f"cannot mark step {step} best: {path} is not a complete checkpoint")
    parent = path.parent
    record = {"step": step, "checkpoint": path.name, "metric": metric, "value": float(value),
              "marked_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    _replace_atomically(parent, BEST_FILE, lambda tmp: _write_file(
        tmp, lambda f: f.write(json.dumps(record, indent=1, sort_keys=True).encode())))
    try:
        _replace_atomically(parent, BEST_LINK, lambda tmp: os.symlink(path.name, tmp, target_is_directory=True))
    except OSError:  # a file system without symlinks: best.json alone is the pointer
        pass
    return path


def read_best(run_dir: str | os.PathLike) -> dict | None:
    """The best pointer ``checkpoints/best.json`` ({"step", "checkpoint", "metric", "value", "marked_at"}), or
    None when there is none or it is unreadable."""
    f = Path(run_dir) / CHECKPOINTS_DIR / BEST_FILE
    try:
        record = json.loads(f.read_text())
        int(record["step"])
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def best_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint the best pointer names (``checkpoints/global_step_<N>``), or None (no pointer, or
    its checkpoint is incomplete or gone). Its ``hf/`` subdirectory (the policy's export) is what ``policy.model_path``
    takes; ``<run_dir>/checkpoints/best/hf`` is the same directory through the link."""
    record = read_best(run_dir)
    if record is None:
        return None
    path = checkpoint_dir(run_dir, int(record["step"]))
    return path if _is_complete(path) else None


def clear_best(run_dir: str | os.PathLike) -> None:
    """Remove the best pointer and link (if any)."""
    parent = Path(run_dir) / CHECKPOINTS_DIR
    for name in (BEST_FILE, BEST_LINK):
        p = parent / name
        if p.is_symlink() or p.is_file():
            p.unlink()
    _fsync_dir(parent)


def sync_best(run_dir: str | os.PathLike, step: int, value: float, metric: str = "eval/success_once") -> Path | None:
    """Make the best pointer agree with a restored run state (a resume or a rollback) whose best eval was at
    ``step`` with ``value`` of ``metric`` (``val/success_once`` with a validation split): point at that step's
    checkpoint when it is complete, else (no best yet, step < 0, or its checkpoint was never written) remove the
    pointer, so a best from a superseded timeline (a step after a rollback's)
    never survives. Returns the best checkpoint or None."""
    step = int(step)
    if step >= 0 and _is_complete(checkpoint_dir(run_dir, step)):
        rec = read_best(run_dir)
        if rec is not None and int(rec["step"]) == step and rec.get("value") == float(value) \
                and rec.get("metric", metric) == metric \
                and (Path(run_dir) / CHECKPOINTS_DIR / BEST_LINK).is_symlink():
            return checkpoint_dir(run_dir, step)
        return mark_best(run_dir, step, value, metric)
    clear_best(run_dir)
    return None
