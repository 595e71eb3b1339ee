"""Deterministic fault injection, for TESTING ONLY: a Dask WorkerPlugin that breaks a worker at an exact task.

The recovery tests (tests/pipelines/test_recovery.py) install `FaultAt` with `client.register_plugin` after the
Runner is built (task keys carry the run id, `pipelines.graphs`): when the task with key `key` starts executing on
the worker at `address`, the plugin

- `kill`:  ends the worker process at once (`os._exit`, as a SIGKILL or an OOM kill would; its Nanny restarts it);
- `pause`: sets the worker's memory pause fraction to ~0, so that its memory monitor pauses it within its interval
  (~100 ms) exactly as a worker over `distributed.worker.memory.pause` is paused; the task that triggered it still
  finishes, nothing after it starts.

A restarted worker gets the plugin again but never sees the key again (a retried step has new keys), so each fault
happens once. Nothing in the run itself imports this module.
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
        self.worker.memory_manager.memory_pause_fraction = 1e-9  # any process memory is above it
