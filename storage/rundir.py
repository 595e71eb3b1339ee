"""Run directories: ``<root>/<experiment>/<run_id>/`` holding config.yaml, checkpoints/, trajectories, logs."""

from __future__ import annotations

import difflib
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path

import yaml

CONFIG_FILE = "config.yaml"


def _check_name(what: str, name: str) -> None:
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    if not name or name in (".", "..") or any(s in name for s in seps):
        raise ValueError(f"{what} {name!r} must be a single non-empty path component (no '/', not '.' or '..')")


STARTED_FILE = ".started"  # the run's start time (ns since the epoch), written once when the run dir is created


def new_run_dir(root: str | os.PathLike, experiment: str, run_id: str) -> Path:
    """Create (or reuse, on resume) ``<root>/<experiment>/<run_id>/`` and return it. A new directory gets
    ``.started`` (its start time in ns), which :func:`latest_started_run` orders by; a resume keeps it."""
    _check_name("experiment", experiment)
    _check_name("run_id", run_id)
    path = Path(root) / experiment / run_id
    path.mkdir(parents=True, exist_ok=True)
    marker = path / STARTED_FILE
    if not marker.exists():
        write_text_atomic(marker, str(time.time_ns()))  # a torn number would misorder `latest_started_run`
    return path


def run_started_ns(run_dir: str | os.PathLike) -> int:
    """When the run in ``run_dir`` was started (ns): its ``.started`` file; for run dirs made before that file
    existed, the time in the run id (``%Y%m%d-%H%M%S-xxxx``), else the directory's ctime."""
    run_dir = Path(run_dir)
    try:
        return int((run_dir / STARTED_FILE).read_text().strip())
    except (OSError, ValueError):
        pass
    try:
        stamp = datetime.strptime("-".join(run_dir.name.split("-")[:2]), "%Y%m%d-%H%M%S")
        return int(stamp.timestamp() * 1e9)
    except ValueError:
        return int(run_dir.stat().st_ctime_ns)


def latest_started_run(exp_dir: str | os.PathLike) -> Path | None:
    """The most recently STARTED run directory under ``<root>/<experiment>`` (by :func:`run_started_ns`, then
    name), whether or not it has a checkpoint; None when there is none. Only directories holding a
    ``config.yaml`` (written at every run's start) count."""
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        return None
    runs = [p for p in exp_dir.iterdir() if p.is_dir() and (p / CONFIG_FILE).is_file()]
    return max(runs, key=lambda p: (run_started_ns(p), p.name), default=None)


def find_run_dir(root: str | os.PathLike, run_id: str) -> Path:
    """The unique ``<root>/*/<run_id>`` directory; errors list close matches or the duplicates."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"runs root {root} does not exist")
    hits = sorted(p for p in root.glob(f"*/{run_id}") if p.is_dir()) if run_id and "/" not in run_id else []
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise ValueError(f"run id {run_id!r} exists in several experiments under {root}: "
                         f"{[str(p) for p in hits]}; pass the run directory itself")
    known = {p.name: p for exp in root.iterdir() if exp.is_dir() for p in exp.iterdir() if p.is_dir()}
    close = [n for n in known if run_id and n.startswith(run_id)]
    close += [n for n in difflib.get_close_matches(run_id, list(known), n=5, cutoff=0.6) if n not in close]
    hint = ", ".join(f"{n} ({known[n].parent.name})" for n in close[:5]) if close else "none"
    raise FileNotFoundError(f"no run {run_id!r} under {root} (looked in {root}/*/{run_id}); close matches: {hint}")


DIGEST_SUFFIX = ".sha256"  # <run dir>/config.yaml.sha256: `sha256sum` format, written with config.yaml


class DamagedRunFile(ValueError):
    """A file of a run that dagrl wrote whole (config.yaml) reads back other than written: empty, or its sha256
    differs from the digest written beside it. One line naming the file and the fix."""


class OldRunFile(DamagedRunFile):
    """A run's config.yaml without its digest ``config.yaml.sha256`` (saved before the digest existed): it cannot
    be verified, so it is refused like a damaged one (a subclass: the readers' ``except DamagedRunFile`` holds), in
    one line naming the file and ``python -m pipelines.upgrade RUN_DIR``, which writes the digest."""


def write_resolved_config(run_dir: str | os.PathLike, yaml_text: str) -> Path:
    """Write ``<run_dir>/config.yaml`` atomically after checking it parses as YAML, then its digest
    ``config.yaml.sha256`` (``sha256sum`` format) that ``read_resolved_config`` checks it against."""
    import hashlib
    try:
        yaml.safe_load(yaml_text)
    except yaml.YAMLError as e:
        raise ValueError(f"resolved config for {run_dir} is not valid YAML: {e}") from None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = write_text_atomic(run_dir / CONFIG_FILE, yaml_text)
    digest = hashlib.sha256(yaml_text.encode()).hexdigest()
    write_text_atomic(run_dir / (CONFIG_FILE + DIGEST_SUFFIX), f"{digest}  {CONFIG_FILE}\n")
    return path


def read_resolved_config(path: str | os.PathLike) -> str:
    """The text of a run's saved ``config.yaml`` (``path``), verified: never empty, and equal (sha256) to the digest
    written beside it (``write_resolved_config``). A YAML file cut at a line boundary still parses, and a config
    missing keys would be read with the schema's defaults in their place, so every reader of a saved config goes
    through here.

    Raises:
        FileNotFoundError: no file at ``path``.
        DamagedRunFile: empty, or the digest differs (one line: the file, the fix).
        OldRunFile: no digest beside it (a run saved before the digest existed; one line: the file and
            ``python -m pipelines.upgrade RUN_DIR``).
    """
    import hashlib
    path = Path(path)
    text = path.read_text()
    fix = ("it was changed or cut after the run wrote it; restore it from a copy (or from the run's MLflow artifact "
           "config.yaml)")
    if not text.strip():
        raise DamagedRunFile(f"{path} is empty; {fix}")
    side = path.with_name(path.name + DIGEST_SUFFIX)
    if not side.is_file():
        raise OldRunFile(f"{path} is of an older format (no {side.name} beside it: saved before the digest "
                         f"existed): rewrite its run once with `python -m pipelines.upgrade {path.parent}`")
    want = side.read_text().split(maxsplit=1)[0] if side.read_text().strip() else ""
    if hashlib.sha256(text.encode()).hexdigest() != want:
        raise DamagedRunFile(f"{path} is damaged (its sha256 differs from {side.name}); {fix}")
    return text


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` so that a reader (or the next run after a crash or a Ctrl-C) finds the old file or
    the complete new one, never a part: written to a unique hidden temporary file beside it, flushed and fsync'd,
    then `os.replace`d onto `path` (atomic on one filesystem); the temporary file is removed if anything fails.
    The parent directory must exist. Returns `path` as a Path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_writable_dir(path: str | os.PathLike) -> None:
    """Pre-flight of a directory a run will write into (``run_root``, ``record.out``'s parent), before any worker
    starts: ``path`` itself when it exists, else its nearest existing parent, must be a directory in which a file
    can be created (probed by creating and removing a temporary file there, so read-only mounts and permissions
    count as they will for the run; nothing else is created).

    Raises:
        ValueError: one line "why; fix" (the caller prefixes the key and value).
    """
    p = Path(path).expanduser().absolute()
    anc = p
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        what = "is" if anc == p else f"would be created under {anc}, which is"
        raise ValueError(f"{p} {what} not a directory; choose a path in a writable directory")
    try:
        with tempfile.TemporaryFile(prefix=".dagrl-write-probe-", dir=anc):
            pass
    except OSError as exc:
        where = "" if anc == p else f" (its nearest existing parent {anc})"
        raise ValueError(f"cannot create files in it{where}: {exc.strerror or exc}; choose a writable directory "
                         f"or fix its permissions") from None


# ----- a run's files vanishing under it -----

class RunDirGone(RuntimeError):
    """What a run writes into was removed or replaced while the run went on: its run directory (or a part of it:
    checkpoints/, evals/, the trajectory store) or its local MLflow store (`storage.tracking.Tracker.store_gone`).
    The message is one line: what vanished, what happened, the fix."""


def dir_identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the directory `path`, or None when it is not there (a directory made again at the same
    path after a removal has another identity)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def run_dir_gone(run_dir: str | os.PathLike, identity: tuple[int, int] | None) -> str | None:
    """None while `run_dir` is the directory whose `dir_identity` was `identity`; else the one line saying it was
    removed (or replaced by another directory at the same path) while the run trained, and what to do."""
    now = dir_identity(run_dir)
    if now is not None and (identity is None or now == identity):
        return None
    what = "removed" if now is None else "removed and replaced by another directory"
    return (f"the run directory {run_dir} was {what} while the run trained; the run stopped and wrote nothing "
            f"more (nothing was re-created there): restore the directory and resume with runner.resume="
            f"{Path(run_dir).name}, or start a new run")


def make_dir_in(parent: str | os.PathLike, *parts: str) -> Path:
    """`<parent>/<parts...>` made (each level that is missing; `exist_ok`) and returned, without ever creating
    `parent` itself: the writers of a run's files (checkpoints, eval records, perf events) call this with the run
    directory as `parent`, so a run directory removed under a running run is not re-created piece by piece.

    Raises:
        RunDirGone: `parent` is not a directory (removed, or never made).
    """
    parent = Path(parent)
    if not parent.is_dir():
        raise RunDirGone(f"{parent} is gone (removed while a run wrote into it): not re-created; restore it or "
                         f"start a new run")
    path = parent.joinpath(*parts)
    for level in [*reversed(path.relative_to(parent).parents[:-1]), path.relative_to(parent)]:
        try:
            (parent / level).mkdir()
        except FileExistsError:
            pass
        except FileNotFoundError:  # `parent` vanished between the check and here
            raise RunDirGone(f"{parent} is gone (removed while a run wrote into it): not re-created; restore it "
                             f"or start a new run") from None
    return path


# ----- one live owner per run directory and per recorded store (storage.locks) -----
LOCK_FILE = ".lock"  # <run dir>/.lock: the driver that owns the run (storage.locks), removed when it ends


def lock_run_dir(run_dir: str | os.PathLike, *, command: str | None = None):
    """Take the owner lock of ``run_dir`` (``<run_dir>/.lock``; the directory is created if missing) for this
    process: call it before anything is written into the run, release it (``.release()`` or ``with``) when the
    driver ends. Returns a ``storage.locks.OwnerLock``; its ``note`` is a one-line takeover note when a dead
    driver's lock was taken over (same host, pid gone or reused).

    Raises:
        storage.locks.LockBusy: another live driver owns the run (one line: pid, host, since when, command, fix);
            on another host, liveness cannot be checked: the line says so and names the lock file.
    """
    from storage.locks import acquire
    run_dir = Path(run_dir)
    return acquire(run_dir / LOCK_FILE, what=f"run {run_dir.name} ({run_dir})", command=command)


def run_owner(run_dir: str | os.PathLike) -> str | None:
    """The one-line refusal for a command that must not write into ``run_dir`` while another process owns it
    (``lock_run_dir``), or None when no live driver owns it (also when this process does). Creates nothing."""
    from storage.locks import busy_message, live_holders
    run_dir = Path(run_dir)
    holders = live_holders(run_dir / LOCK_FILE)
    return busy_message(f"run {run_dir.name} ({run_dir})", run_dir / LOCK_FILE, holders) if holders else None


def store_lock_file(store: str | os.PathLike) -> Path:
    """The lock file of a trajectory store path: ``<store>.lock`` beside it, the same for the ``<store>.partial``
    a recording writes first (pipelines.record), so that a reader of either meets the recording's lock."""
    p = Path(store).absolute()
    name = p.name.removesuffix(".partial") if p.name.endswith(".partial") else p.name
    return p.with_name(name + ".lock")


def lock_store(store: str | os.PathLike, *, shared: bool = False, command: str | None = None):
    """Take the lock of a trajectory store path outside a run directory (``store_lock_file``): exclusive for its
    writer (pipelines.record), ``shared`` for a run that reads it for its life (``sft.store``). Returns a
    ``storage.locks.OwnerLock``.

    Raises:
        storage.locks.LockBusy: a recording writes it (any request), or a live run reads it (an exclusive
            request); one line naming the holder(s) and the fix.
    """
    from storage.locks import acquire
    return acquire(store_lock_file(store), what=f"trajectory store {Path(store)}", shared=shared, command=command)


def store_owner(store: str | os.PathLike, *, readers: bool = True) -> str | None:
    """The one-line refusal for writing the trajectory store ``store`` (a recording writes it, or with ``readers``
    a live run reads it: ``lock_store``), or None when it is free (also when this process holds it). For a
    reader (``readers=False``): only a recording counts. Creates nothing."""
    from storage.locks import busy_message, live_holders
    path = store_lock_file(store)
    holders = live_holders(path, writers_only=not readers)
    return busy_message(f"trajectory store {Path(store)}", path, holders) if holders else None
