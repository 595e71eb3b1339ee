"""One live owner per run directory and per store (storage.locks, storage.rundir.lock_run_dir / lock_store), issue
47 item 1: a second writer is refused naming the holder and changes nothing; a holder killed with SIGKILL leaves a
lock that the next one takes over with a note; the lock is gone after a normal end and after an exception; a pid
reused by another process does not keep a dead holder's lock alive. Holders are real processes where the property
is about processes (a tiny `python -c` holding the lock)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.locks import LockBusy, process_start, read_holders
from storage.rundir import (LOCK_FILE, lock_run_dir, lock_store, run_owner, store_lock_file, store_owner,
                            write_resolved_config)

ROOT = Path(__file__).resolve().parents[2]
HOLD = r"""
import sys, time
from storage.rundir import lock_run_dir, lock_store
kind, path, then = sys.argv[1:4]
lock = lock_run_dir(path) if kind == "run" else lock_store(path, shared=kind == "read")
print("held", flush=True)
if then == "sleep":
    time.sleep(600)
elif then == "raise":
    with lock:
        raise RuntimeError("the holder failed")
else:  # a normal end
    with lock:
        pass
"""


def _holder(kind: str, path, then: str = "sleep") -> subprocess.Popen:
    """A process that takes the lock (`kind`: run, write (a store), read (a store, shared)) and then sleeps, ends
    normally or raises; returns once it holds the lock."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, kind, str(path), then], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip() == "held", (line, p.stderr.read() if p.poll() is not None else "")
    return p


def _stop(p: subprocess.Popen, sig=signal.SIGKILL) -> None:
    if p.poll() is None:
        p.send_signal(sig)
    p.wait(timeout=30)


def _listing(d: Path) -> dict[str, tuple[int, int]]:
    """Every path under `d` (and `d` itself) -> (size, mtime in ns): what a refused writer must leave unchanged."""
    out = {".": (0, d.stat().st_mtime_ns)}
    for p in d.rglob("*"):
        st = p.stat()
        out[str(p.relative_to(d))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


def _a_run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "smoke" / "20260101-000000-beef"
    (d / "checkpoints" / "global_step_2").mkdir(parents=True)
    write_resolved_config(d, "experiment: smoke\n")
    (d / ".started").write_text("1")
    return d


def test_a_second_driver_is_refused_naming_the_holder_and_nothing_changes(tmp_path):
    run_dir = _a_run_dir(tmp_path)
    a = _holder("run", run_dir)
    try:
        before = _listing(run_dir)
        time.sleep(0.01)  # a write now would show in an mtime
        with pytest.raises(LockBusy) as exc:
            lock_run_dir(run_dir)
        msg = str(exc.value)
        assert "\n" not in msg
        for part in (f"pid {a.pid}", f"host {socket.gethostname()}", "since ", "python -c", f"kill {a.pid}",
                     run_dir.name):
            assert part in msg, (part, msg)
        assert [h.pid for h in exc.value.holders] == [a.pid]
        assert run_owner(run_dir) == msg  # the read-only probe says the same, and takes nothing
        assert _listing(run_dir) == before
        assert a.poll() is None  # the holder runs on, untouched
    finally:
        _stop(a)


def test_a_sigkilled_holder_is_taken_over_with_a_note(tmp_path):
    run_dir = _a_run_dir(tmp_path)
    a = _holder("run", run_dir)
    _stop(a, signal.SIGKILL)  # no release: its line stays in the lock file, the kernel dropped the flock
    assert [h.pid for h in read_holders(run_dir / LOCK_FILE)] == [a.pid]
    assert run_owner(run_dir) is None  # a dead holder does not own the run
    with lock_run_dir(run_dir) as lock:
        assert lock.note is not None and "\n" not in lock.note
        assert f"pid {a.pid}" in lock.note and "no longer running" in lock.note
        assert [h.pid for h in read_holders(run_dir / LOCK_FILE)] == [os.getpid()]  # the file names the new owner
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.parametrize("then, rc", [("end", 0), ("raise", 1)])
def test_the_lock_is_released_after_a_normal_end_and_after_an_exception(tmp_path, then, rc):
    run_dir = _a_run_dir(tmp_path)
    a = _holder("run", run_dir, then)
    assert a.wait(timeout=30) == rc
    assert not (run_dir / LOCK_FILE).exists()  # released: nothing left to take over
    with lock_run_dir(run_dir) as lock:
        assert lock.note is None
    # in this process too: an exception leaving the `with` releases it
    with pytest.raises(RuntimeError):
        with lock_run_dir(run_dir):
            raise RuntimeError("boom")
    with lock_run_dir(run_dir) as lock:
        assert lock.note is None


def _fake_line(run_dir: Path, *, pid: int, proc_start: float, host: str | None = None) -> None:
    """A holder's line with no flock behind it: what a dead driver leaves, or a filesystem without flock shows."""
    line = {"pid": pid, "host": host or socket.gethostname(), "proc_start": proc_start, "since": time.time() - 60,
            "command": "python -m pipelines.run conf=smoke", "mode": "exclusive"}
    (run_dir / LOCK_FILE).write_text(json.dumps(line) + "\n")


def test_a_reused_pid_does_not_keep_a_dead_holders_lock(tmp_path):
    run_dir = _a_run_dir(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        real_start = None
        for _ in range(100):
            real_start = process_start(other.pid)
            if real_start is not None:
                break
            time.sleep(0.05)
        # the pid runs, but a process started an hour after the one that took the lock: the pid was reused
        _fake_line(run_dir, pid=other.pid, proc_start=real_start - 3600)
        with lock_run_dir(run_dir) as lock:
            assert f"pid {other.pid}" in lock.note and "now runs another process" in lock.note
        # the same pid AND start time, with no flock held (a filesystem that does not honour flock): refused
        _fake_line(run_dir, pid=other.pid, proc_start=real_start)
        with pytest.raises(LockBusy, match=rf"pid {other.pid} on host"):
            lock_run_dir(run_dir)
    finally:
        _stop(other)
    # the same line once that process is gone: stale, taken over
    with lock_run_dir(run_dir) as lock:
        assert "no longer running" in lock.note


def test_another_hosts_holder_cannot_be_checked_and_is_not_taken_over(tmp_path):
    run_dir = _a_run_dir(tmp_path)
    _fake_line(run_dir, pid=os.getpid(), proc_start=0.0, host="elsewhere.example")
    with pytest.raises(LockBusy) as exc:
        lock_run_dir(run_dir)
    msg = str(exc.value)
    assert "host elsewhere.example" in msg and "cannot be checked" in msg and str(run_dir / LOCK_FILE) in msg
    assert run_owner(run_dir) == msg


def test_one_process_cannot_hold_a_run_twice(tmp_path):
    run_dir = _a_run_dir(tmp_path)
    with lock_run_dir(run_dir):
        with pytest.raises(LockBusy, match="this process already"):
            lock_run_dir(run_dir)
        assert run_owner(run_dir) is None  # this process owns it: not someone else


def test_store_locks_one_recording_no_recording_under_a_reader_readers_share(tmp_path):
    store = tmp_path / "demos" / "x.zarr"
    assert store_lock_file(Path(str(store) + ".partial")) == store_lock_file(store)  # a recording's partial store
    rec = _holder("write", store)
    try:
        with pytest.raises(LockBusy, match=rf"trajectory store .* in use by pid {rec.pid}"):
            lock_store(store)  # a second recording to the same path
        with pytest.raises(LockBusy, match=rf"pid {rec.pid}"):
            lock_store(Path(str(store) + ".partial"), shared=True)  # a run reading it while it is recorded
        assert f"pid {rec.pid}" in store_owner(store, readers=False)
    finally:
        _stop(rec)
    r1, r2 = _holder("read", store), _holder("read", store)  # two runs may read one store
    try:
        with pytest.raises(LockBusy) as exc:
            lock_store(store)  # but nobody records into it meanwhile
        assert "read by" in str(exc.value) and {h.pid for h in exc.value.holders} == {r1.pid, r2.pid}
        assert store_owner(store, readers=False) is None and f"pid {r1.pid}" in store_owner(store)
        with lock_store(store, shared=True):  # a third reader
            pass
    finally:
        _stop(r1)
        _stop(r2)
    with lock_store(store) as lock:  # the readers are gone: a recording may start (the SIGKILLed one's is stale)
        assert f"pid {rec.pid}" in lock.note and "no longer running" in lock.note
    with lock_store(store) as lock:  # released at its end: nothing stale
        assert lock.note is None
    with lock_store(store, shared=True):  # a lone reader, the last one out, removes the file too
        assert store_lock_file(store).exists()
    assert not store_lock_file(store).exists()
