"""Dask preload of the embedded cluster's worker processes (`pipelines.cluster.start_cluster` gives it to every
Nanny as `preload`): `dask_setup(worker)` runs in each worker process as it starts, restarts (recovery) included.

A terminal's Ctrl-C reaches every process of its process group, the local workers too; a worker that took it
would print its own KeyboardInterrupt traceback (dozens of lines each) and die under the driver. The workers ignore
SIGINT: the driver decides (finish the step and checkpoint, or exit at once) and closes them.
"""
from __future__ import annotations


def dask_setup(worker) -> None:
    """Ignore SIGINT in this worker process (its event loop runs on the main thread: the Nanny's worker process)."""
    import signal
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread (an in-process worker): the driver's process decides anyway
        pass
