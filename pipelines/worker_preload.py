"""Dask preload of the embedded cluster's worker processes (`pipelines.cluster.start_cluster` gives it to every
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
other worker error still shows.
"""
from __future__ import annotations

import logging


class PeerGoneFilter(logging.Filter):
    """Drops `distributed.worker`'s "failed during get data" records (logged with an OSError: the peer that asked
    for the data is gone). The driver reports lost workers itself (pipelines.runner.recovery)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("failed during get data") and record.exc_info is not None
                    and isinstance(record.exc_info[1], OSError))


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
    if threading.current_thread() is not threading.main_thread():
        return
    if multiprocessing.parent_process() is not None:  # a worker process the Nanny spawned (never the driver)
        try:
            os.setsid()
        except OSError:  # already a session leader: the SIGINT rule below still holds
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
