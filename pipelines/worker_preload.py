"""Dask preload of the embedded cluster's worker processes (`pipelines.clusters.start_cluster` gives it to every
Nanny as `preload`): `dask_setup(worker)` runs in each worker process as it starts, restarts (recovery) included.

A terminal's Ctrl-C reaches every process of its process group, the local workers too; a worker that took it
would print its own KeyboardInterrupt traceback (dozens of lines each) and die under the driver. Likewise a SIGTERM
to the whole group (GNU `timeout`, Slurm's `scancel`, systemd's stop of a unit) killed every worker at once: the
driver, asked to finish its step and checkpoint, found its workers lost instead, rolled back to its last checkpoint
(a fresh actor when there was none) and checkpointed that, so the steps since were lost. The workers therefore
leave the driver's session (`os.setsid`: no signal sent to the driver's process group or terminal reaches them)
and ignore SIGINT as well: the driver decides (finish the step and checkpoint, or exit at once) and closes them.
They still end with the driver however it ends: Dask's worker process exits as soon as its parent is gone
(`distributed.process.AsyncProcess`, the parent-alive pipe).

When a worker is lost mid-step, a surviving worker that was sending it data logged Dask's "failed during get data"
error with a ~20-line ConnectionResetError traceback before the driver's own one-line report ("worker(s) [...]
lost during step N; retrying"): that record (an OSError while serving a peer that went away) is dropped here; any
other worker error still shows. Likewise Dask's "Compute Failed" record of a task that raised and its "Worker stream
died" record of a lost peer are kept off the console (`DriverReportsFilter`): the driver reports both.
"""
from __future__ import annotations

import logging


class PeerGoneFilter(logging.Filter):
    """Drops `distributed.worker`'s "failed during get data" records (logged with an OSError: the peer that asked
    for the data is gone). The driver reports lost workers itself (pipelines.runner.watcher)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("failed during get data") and record.exc_info is not None
                    and isinstance(record.exc_info[1], OSError))


class DriverReportsFilter(logging.Filter):
    """On the console handlers of a worker process (and the driver's, which holds the embedded scheduler): drops
    distributed's records of failures the driver reports itself, each in one line, where they printed a ~20-line
    traceback beside it:

    * `distributed.worker` "Compute Failed" (a task raised: the exception reaches the driver, which waits on every
      task it submits; the known kinds become one line: a non-finite value, a failed checkpoint write, a vanished
      run dir; anything else is raised by the driver with the task's traceback, so no error is hidden);
    * `distributed.worker` "Worker stream died during communication" with an OSError (a peer worker was lost while
      this one fetched data from it: the driver reports the lost worker and retries the step).
    * `distributed.worker` "Failed to communicate with scheduler during heartbeat" with an OSError: the embedded
      workers' scheduler lives in the driver, so this is the driver gone (killed: its user knows; it ended: it said
      so) or a heartbeat late on an oversubscribed machine (the driver's watch names a worker it does not hear from).

    Only the console drops them: they stay in the worker's own log (`Client.get_worker_logs()`, the dashboard's
    worker logs), which is held by a non-stream handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if record.name == "distributed.worker" and msg.startswith("Compute Failed"):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not (msg.startswith(("Worker stream died during communication",
                                    "Failed to communicate with scheduler during heartbeat"))
                    and isinstance(exc, OSError))


def route_reported_failures() -> None:
    """Add `DriverReportsFilter` (once) to every console handler (a StreamHandler that is not a FileHandler) of the
    `distributed` logger and of the root logger in this process. Called by `dask_setup` in each worker and by
    `pipelines.clusters.start_cluster` in the driver."""
    for name in ("distributed", None):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                    and not any(isinstance(f, DriverReportsFilter) for f in handler.filters):
                handler.addFilter(DriverReportsFilter())


def dask_setup(worker) -> None:
    """In a worker process the Nanny spawned: leave the driver's session; on any main thread: ignore SIGINT. An
    in-process worker (its loop on another thread of the driver) changes nothing: the driver decides anyway."""
    import multiprocessing
    import os
    import signal
    import threading
    log = logging.getLogger("distributed.worker")
    if not any(isinstance(f, PeerGoneFilter) for f in log.filters):  # once per process (in-process workers share it)
        log.addFilter(PeerGoneFilter())
    route_reported_failures()
    if threading.current_thread() is not threading.main_thread():
        return
    if multiprocessing.parent_process() is not None:  # a worker process the Nanny spawned (never the driver)
        try:
            os.setsid()
        except OSError:  # already a session leader: the SIGINT rule below still holds
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
