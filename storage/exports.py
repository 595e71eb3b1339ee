"""Model directories a run reads or writes outside its checkpoints' own files: an export's file index
(``dagrl_files.json``, :func:`index_export` / :func:`export_damage`: a checkpoint's ``hf/``, the `save_pretrained`
layout `policy.model_path` takes) and the identity of a model directory (:func:`directory_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from storage.checkpoints import INDEX_FILE, _sha256, _verify_files, _write_file

EXPORT_INDEX = "dagrl_files.json"  # an export directory's (hf/) own index: index_export / export_damage


def index_export(path: str | os.PathLike) -> Path:
    """Write ``<path>/dagrl_files.json`` (EXPORT_INDEX): size and sha256 of every other file of an export directory
    (a checkpoint's ``hf/``, the `save_pretrained` layout `policy.model_path` takes), fsynced, written after the
    files. The index travels with the directory when it is copied out of its run, so :func:`export_damage` can check
    it anywhere. Returns the index's path."""
    path = Path(path)
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(path.iterdir()) if p.is_file() and p.name != EXPORT_INDEX}
    out = path / EXPORT_INDEX
    _write_file(out, lambda f: f.write(json.dumps({"files": files}, indent=1, sort_keys=True).encode()))
    return out


def export_damage(path: str | os.PathLike) -> str | None:
    """One line naming what is wrong with an export directory written with :func:`index_export` (a listed file
    missing, of another size or other sha256; an unreadable index), or None when it is intact. An export without
    the index (another tool's `save_pretrained`) counts as intact: nothing to check it against."""
    path = Path(path)
    index = path / EXPORT_INDEX
    if not index.is_file():
        return None
    try:
        files = json.loads(index.read_text())["files"]
        _verify_files(path, files, EXPORT_INDEX)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        msg = str(exc) if isinstance(exc, (ValueError, OSError)) and str(exc).startswith("checkpoint ") else \
            f"{index} is unreadable ({type(exc).__name__}: {exc})"
        return " ".join(msg.split())
    return None


_SAMPLED_ABOVE = 64 << 20  # files larger than this are fingerprinted from samples (see `directory_fingerprint`)
_SAMPLES, _SAMPLE_BYTES = 64, 64 << 10


def directory_fingerprint(path: str | os.PathLike) -> str:
    """The identity of a model directory a run reads from outside its run dir (`policy.model_path`: an exported
    ``hf/`` or a checkpoint), cheap enough to take at every start and resume. One line:

    - a directory with a dagrl index (``dagrl_files.json`` of :func:`index_export`, or a checkpoint's
      ``index.json``, both listing every file's sha256): ``index <name> sha256 <16 hex>`` of that index (one small
      read; its files are verified against it elsewhere: ``export_damage``, ``verify_checkpoint``);
    - any other directory: ``files sha256 <16 hex> (<n> files, <MB> MB)`` over every file's relative path, size and
      content: whole for files up to 64 MiB, 64 blocks of 64 KiB spread evenly over a larger file plus its
      last block (about 4 MiB read per weights file: retrained weights of the same shape differ in every block;
      a change confined to a few tensors of a larger file may fall between samples).

    Raises:
        FileNotFoundError: ``path`` is not a directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    for name in (EXPORT_INDEX, INDEX_FILE):
        if (path / name).is_file():
            return f"index {name} sha256 {hashlib.sha256((path / name).read_bytes()).hexdigest()[:16]}"
    h, count, total = hashlib.sha256(), 0, 0
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.relative_to(path).as_posix()}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= _SAMPLED_ABOVE:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            else:
                for i in range(_SAMPLES + 1):
                    fh.seek(min(i * (size // _SAMPLES), size - _SAMPLE_BYTES))
                    h.update(fh.read(_SAMPLE_BYTES))
        count, total = count + 1, total + size
    return f"files sha256 {h.hexdigest()[:16]} ({count} files, {total / 1e6:.1f} MB)"
