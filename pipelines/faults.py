"""Deterministic fault injection, for TESTING ONLY: a Dask WorkerPlugin that breaks a worker at an exact task.

The recovery tests (tests/pipelines/test_recovery.py) install `FaultAt` with `client.register_plugin` after the
Runner is built (task keys carry the run id, `pipelines.graphs`): when the task with key `key` starts executing on
the worker at `address`, the plugin

- `kill`:  ends the worker process at once (`os._exit`, as a SIGKILL or an OOM kill would; its Nanny restarts it);
- `pause`: pauses the worker at once as its memory monitor pauses a worker over `distributed.worker.memory.pause`
  (status paused) and sets its pause fraction to ~0, so that the monitor keeps it paused; the task that triggered
  it still finishes, nothing after it starts.

A restarted worker gets the plugin again but never sees the key again (a retried step has new keys), so each fault
happens once. `restore_pause` (run on a worker) undoes a pause, for tests that share one cluster. Nothing in the
run itself imports this module.
"""
from __future__ import annotations

import os

from distributed.diagnostics.plugin import WorkerPlugin


class FaultAt(WorkerPlugin):
    """Break the worker at `address` when task `key` (exact, as a string) starts executing: action kill | pause."""

    ACTIONS = ("kill", "pause")

    def __init__(self, address: str, key: str, action: str):
        if action not in self.ACTIONS:
            raise ValueError(f"action {action!r}; known: {list(self.ACTIONS)}")
        self.address, self.key, self.action = address, key, action
        self.worker = None

    def setup(self, worker) -> None:
        self.worker = worker

    def transition(self, key, start, finish, **kwargs) -> None:
        if finish != "executing" or str(key) != self.key or self.worker is None \
                or self.worker.address != self.address:
            return
        if self.action == "kill":
            os._exit(1)
        mm = self.worker.memory_manager
        if not hasattr(self.worker, "_dagrl_pause_before"):
            self.worker._dagrl_pause_before = mm.memory_pause_fraction
        mm.memory_pause_fraction = 1e-9  # any process memory is above it: the monitor keeps it paused
        # ... and paused now, as the monitor does it (worker_memory: worker.status = Status.paused), on the event
        # loop right after this transition: the triggering task runs, the next one (queued behind it on the
        # worker's thread) never starts — a short task could otherwise finish before the monitor's next tick
        self.worker.loop.add_callback(_pause_now, self.worker)


def _pause_now(worker) -> None:
    from distributed.core import Status
    if worker.status == Status.running:
        worker.status = Status.paused


def restore_pause(dask_worker) -> bool:
    """`client.run(restore_pause, workers=[...])`: give a worker paused by `FaultAt(..., "pause")` its pause
    fraction back (its memory monitor then resumes it within ~100 ms), so that a test leaves the cluster whole.
    Returns whether the worker had been paused by a fault."""
    before = getattr(dask_worker, "_dagrl_pause_before", None)
    if before is None:
        return False
    dask_worker.memory_manager.memory_pause_fraction = before
    del dask_worker._dagrl_pause_before
    return True
