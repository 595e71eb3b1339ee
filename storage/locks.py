"""Owner locks: one live writer of a run directory or a store, named in every refusal.

A lock is a small file (`<run dir>/.lock`, `<store>.lock`: `storage.rundir`) held with `fcntl.flock` on a
descriptor kept open for the holder's life. The kernel drops a flock when its process ends in any way (SIGKILL and
a crash included), so on one host a dead driver never leaves a lock behind. The file also carries each holder's
identity, one JSON line per holder (`Holder`: pid, host, the process's start time, when the lock was taken, the
command), for the message that refuses a second writer.

Modes: exclusive (a writer: a training run, a recording, `pipelines.perf --write`) and shared (a reader that must
not see the data change under it for its whole life: a run training on `sft.store`). Shared holders may be many; an
exclusive one excludes every other.

Released at the holder's exit (`OwnerLock.release`, or the context manager): an exclusive holder, or the last shared
one, removes the file (only if it is still the file it locked); another shared holder just closes its descriptor.
A file left with an exclusive holder's line that no process holds is STALE (its driver died before releasing); the
next exclusive holder checks the line and takes over, returning a one-line note (`OwnerLock.note`):

- same host: the pid is not running, or it runs a different process (its start time differs: the pid was reused)
  -> taken over; the pid runs the same process -> refused (a filesystem whose flocks are not honoured);
- another host: whether that process runs cannot be checked from here -> refused, naming the lock file to remove once
  the user knows that driver is gone. (NFS with working locks holds a flock across hosts, and the line is removed at
  release, so this only happens when that driver or its host died, or locks are local to each host, e.g. NFS
  mounted with `local_lock=flock`.)

Where `flock` is not supported at all (ENOLCK, EOPNOTSUPP: some network filesystems) the lines alone decide, as
above, without the kernel's guarantee against two simultaneous starts.

Holding a lock does not stop a reader that takes none (`pipelines.replay`, `pipelines.eval`): they read only
completed data (complete store steps, complete checkpoints) and write only their own outputs.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_START_TOLERANCE_S = 0.05  # process start times from psutil are exact to the clock tick (10 ms) within one boot
# lock file (absolute) -> the lock this process holds on it; weak: a holder dropped unreleased frees it (__del__)
_HELD: "weakref.WeakValueDictionary[str, OwnerLock]" = weakref.WeakValueDictionary()


class LockBusy(RuntimeError):
    """Another live process holds the lock. The message is one line naming the holder(s) (pid, host, since when,
    command) and the fix; `holders` lists them."""

    def __init__(self, message: str, holders: list["Holder"]):
        super().__init__(message)
        self.holders = holders


@dataclass(frozen=True)
class Holder:
    """One holder of a lock as written in its file.

    pid: process id on `host`; host: `socket.gethostname()`; proc_start: the process's start time (s since the
    epoch, `psutil.Process.create_time`; tells a reused pid apart); since: when it took the lock (s since the
    epoch); command: its command line; mode: "exclusive" or "shared"."""

    pid: int
    host: str
    proc_start: float
    since: float
    command: str
    mode: str = "exclusive"

    def describe(self) -> str:
        """`pid 123 on host h since 2026-12-06 12:03:04 (python -m pipelines.run conf=smoke)`."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        cmd = self.command if len(self.command) <= 200 else self.command[:197] + "..."
        return f"pid {self.pid} on host {self.host} since {when} ({cmd})"

    def state(self) -> str:
        """"alive" (this host, the pid runs the process that took the lock), "dead" (this host, the pid is gone
        or now another process: a reused pid), or "unknown" (another host: not checkable from here)."""
        if self.host != socket.gethostname():
            return "unknown"
        start = process_start(self.pid)
        if start is None or (start != -1.0 and abs(start - self.proc_start) > _START_TOLERANCE_S):
            return "dead"
        return "alive"


def process_start(pid: int) -> float | None:
    """The start time (s since the epoch) of process `pid` on this host, None when no such process runs, -1.0 when
    it runs but its start time cannot be read (permissions)."""
    import psutil
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, ProcessLookupError):
        return None
    except psutil.AccessDenied:  # it runs, but its start time cannot be read: taken as the same process
        return -1.0


def command_line() -> str:
    """This process's command as a user typed it: `python -m pipelines.run conf=smoke ...` for a module run with
    -m, else the interpreter's argv."""
    import shlex
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    args = [shlex.quote(a) for a in sys.argv[1:]]
    if spec is not None and getattr(spec, "name", None):
        return " ".join(["python", "-m", spec.name.removesuffix(".__main__"), *args])
    return " ".join(["python", *(shlex.quote(a) for a in sys.argv[:1]), *args]) if sys.argv else "python"


def me(mode: str, command: str | None = None) -> Holder:
    """The Holder this process writes when it takes a lock in `mode`."""
    return Holder(pid=os.getpid(), host=socket.gethostname(), proc_start=process_start(os.getpid()) or 0.0,
                  since=time.time(), command=command or command_line(), mode=mode)


def read_holders(path: str | os.PathLike) -> list[Holder]:
    """The holders written in lock file `path` (none when it does not exist or is empty; unreadable lines are
    skipped: a holder killed while writing its line)."""
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(Holder(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return out


class OwnerLock:
    """A lock held by this process (`acquire`): `path` (the lock file), `holder` (this process's line), `note`
    (the one-line takeover note, None when nothing stale was taken over). `release()` (idempotent), also as a
    context manager."""

    def __init__(self, path: Path, fd: int | None, holder: Holder, note: str | None):
        self.path, self._fd, self.holder, self.note = path, fd, holder, note
        self.held = True

    def release(self) -> None:
        """Give the lock up: an exclusive holder, or the last shared one, removes the file (if the path still is the
        file it locked: a run dir deleted meanwhile is not re-created), then the descriptor is closed (the flock
        goes with it)."""
        if not self.held:
            return
        self.held = False
        _HELD.pop(str(self.path), None)
        try:
            if self.holder.mode == "shared" and self._fd is not None:
                import fcntl
                try:  # the last reader can take it exclusively: nobody else holds it
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    last = True
                except OSError:
                    last = False
            else:
                last = True
            if last and _same_file(self.path, self._fd):
                self.path.unlink(missing_ok=True)
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "OwnerLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):  # a holder dropped without release (a test, an error path): the flock goes with the fd
        try:
            if self.held and self._fd is not None:
                os.close(self._fd)
                self._fd = None
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _same_file(path: Path, fd: int | None) -> bool:
    """Whether `path` still names the file open on `fd` (it was not removed or replaced)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if fd is None:
        return True
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _busy_message(what: str, path: Path, holders: list[Holder]) -> str:
    """One line: who holds `what`, and the fix."""
    if not holders:
        return (f"{what} is in use by another process (it has not written its name in {path} yet); wait for it "
                f"to end, then run this again")
    names = "; ".join(h.describe() for h in holders)
    verb = "read by" if all(h.mode == "shared" for h in holders) else "in use by"
    remote = [h for h in holders if h.state() == "unknown"]
    if remote:
        return (f"{what} is {verb} {names}: another host, so whether it still runs cannot be checked from here; "
                f"wait for it to end, or once sure it is gone, remove {path} and run this again")
    pids = " ".join(str(h.pid) for h in holders)
    return f"{what} is {verb} {names}; wait for it to end or stop it (kill {pids}), then run this again"


def _stale_note(what: str, stale: list[Holder]) -> str | None:
    if not stale:
        return None
    h = stale[0]
    why = ("that pid now runs another process" if process_start(h.pid) is not None
           else "that process is no longer running")
    return f"taking over the lock of {what} left by {h.describe()}: {why}"


def acquire(path: str | os.PathLike, *, what: str, shared: bool = False, command: str | None = None) -> OwnerLock:
    """Take the lock file `path` (created with its parent directory if missing), exclusive or `shared`, without
    waiting. `what` names the locked thing in messages ("run directory runs/x/y").

    Returns the OwnerLock (its `note` is set when a stale exclusive holder was taken over).

    Raises:
        LockBusy: another live process holds it (an exclusive holder, or for an exclusive request also shared
            holders), another host's holder cannot be checked, or this process holds it already; the message is
            one line naming the holder(s) and the fix.
        OSError: the lock file cannot be created (permissions, a read-only filesystem).
    """
    path = Path(path).absolute()
    mode = "shared" if shared else "exclusive"
    if str(path) in _HELD:
        raise LockBusy(f"{what} is in use by this process already ({_HELD[str(path)].holder.describe()})",
                       [_HELD[str(path)].holder])
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(20):  # the file was removed by its releasing holder between our open and our flock: again
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        flocked = True
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            live = [h for h in read_holders(path) if h.state() != "dead" and (shared is False or h.mode != "shared")]
            raise LockBusy(_busy_message(what, path, live), live) from None
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            flocked = False  # no flock on this filesystem: the holders' lines decide
        if _same_file(path, fd):
            break
        os.close(fd)
    else:  # pragma: no cover - 20 releases in a row between open and flock
        raise LockBusy(f"{what}: its lock file {path} keeps being replaced; run this again", [])
    try:
        recorded = read_holders(path)
        # an exclusive line that no flock protects: stale (dead), live (flocks not honoured), or not checkable
        # (another host); shared lines are trusted to the flock unless flock is missing altogether
        checked = [h for h in recorded if h.mode == "exclusive" or not flocked]
        if shared:
            checked = [h for h in checked if h.mode == "exclusive"]
        live = [h for h in checked if h.state() != "dead"]
        if live:
            raise LockBusy(_busy_message(what, path, live), live)
        holder = me(mode, command)
        line = (json.dumps(asdict(holder)) + "\n").encode()
        if shared:  # other readers' lines stay; one short append is atomic
            os.lseek(fd, 0, os.SEEK_END)
            os.write(fd, line)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, line, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    lock = OwnerLock(path, fd, holder, _stale_note(what, [h for h in checked if h.mode == "exclusive"]))
    _HELD[str(path)] = lock
    return lock


def live_holders(path: str | os.PathLike, *, writers_only: bool = True) -> list[Holder]:
    """Who holds lock file `path` now, other than this process, without taking it or creating anything:
    the exclusive holder (`writers_only`; else also shared ones). A stale line (its process is gone) does not
    count; an exclusive line of another host that no flock protects counts (it cannot be checked). [] when free.
    """
    import fcntl
    path = Path(path).absolute()
    if str(path) in _HELD:
        return []
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if writers_only else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            busy = False
        except BlockingIOError:
            busy = True
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            busy = False
        holders = [h for h in read_holders(path) if not writers_only or h.mode == "exclusive"]
        if busy:
            return [h for h in holders if h.state() != "dead"] or [Holder(0, "?", 0.0, 0.0, "?")]
        return [h for h in holders if h.mode == "exclusive" and h.state() != "dead"]
    finally:
        os.close(fd)


def busy_message(what: str, path: str | os.PathLike, holders: list[Holder]) -> str:
    """The one-line refusal `acquire` raises, for a caller that found `holders` with `live_holders`."""
    return _busy_message(what, Path(path).absolute(), [h for h in holders if h.pid])
