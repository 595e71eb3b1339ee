"""What the scheduler says about its workers (any cluster kind): the full worker list, waiting for workers, their
health for the driver's watch (pipelines.runner.watcher), a worker's memory pause fraction, and the driver's and
its children's resident memory.
"""
from __future__ import annotations


def cluster_info(client) -> dict:
    """The scheduler's identity with EVERY worker (`{"address", "workers": {address: info}, ...}`, as
    `Client.scheduler_info(n_workers=-1)` documents it), asked of the scheduler now; a dict is returned as it is
    (tests and the placement checks take one).

    Not `Client.scheduler_info()` (in distributed < 2026.11, which the version range admits): it refreshes a cache
    that the client's own periodic update (every `distributed.client.scheduler-info-interval`, 2 s) overwrites with an answer listing NO worker, and returns the
    cache after the refresh; on a loaded machine the update often lands in between (measured at load 15: 2 of 460
    answers missed live workers, the direct query 0 of 415), so the watch saw every placed worker "lost (left the
    cluster or restarted)" at once, and its second look 2 s later, in step with that period, agreed."""
    if isinstance(client, dict):
        return client
    from distributed import Client
    if not isinstance(client, Client):  # a stand-in (tests) answers scheduler_info itself
        return client.scheduler_info(n_workers=-1)
    return dict(client.sync(client.scheduler.identity, n_workers=-1))


def wait_for_workers(client, n: int, timeout: float) -> int:
    """Wait up to `timeout` s for `n` workers registered with the scheduler, in any state; returns how many there
    are. (Not `Client.wait_for_workers`: it counts running workers only, so a worker paused for memory makes it wait
    out its timeout and raise.)"""
    import time
    deadline = time.monotonic() + timeout
    while True:
        have = len(cluster_info(client)["workers"])
        if have >= n or time.monotonic() > deadline:
            return have
        time.sleep(0.5)


def cluster_rss_bytes() -> int:
    """Resident memory of this driver process and all its child processes (scheduler, nannies, workers)."""
    import psutil
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total



# ----- worker health (pipelines.runner.watcher's watch) -----

def _health_on_scheduler(addrs: list[str], dask_scheduler=None) -> dict:
    """Runs on the scheduler: see `worker_health`."""
    from distributed.metrics import time as now
    t = now()
    out = {}
    for a in addrs:
        ws = dask_scheduler.workers.get(a)
        if ws is None:
            continue
        out[a] = {"name": str(ws.name), "status": ws.status.name, "memory": int(ws.memory.process),
                  "memory_limit": ws.memory_limit or None, "silent_s": float(t - ws.last_seen),
                  "executing": {str(ts.key): float(d) for ts, d in ws.executing.items()},
                  "processing": len(ws.processing)}
    return out


def worker_health(client, addrs: list[str]) -> dict[str, dict]:
    """The scheduler's view of the workers at `addrs` (absent ones are left out), in one query.

    Returns: address -> {"name", "status" ("running" | "paused" | ...), "memory" (process bytes, int),
    "memory_limit" (bytes or None), "silent_s" (seconds since the worker's last heartbeat), "executing"
    ({key: seconds it has been executing}), "processing" (tasks assigned to it)}.
    """
    return client.run_on_scheduler(_health_on_scheduler, list(addrs))


def _pause_fraction(dask_worker):
    """Runs on a worker: its memory pause fraction (False: never pauses)."""
    return dask_worker.memory_manager.memory_pause_fraction


def pause_fraction(client, addr: str, timeout: float = 10.0):
    """The memory pause fraction of the worker at `addr` (a paused worker still answers), or None if it does
    not answer within `timeout` seconds."""
    import threading
    box: dict = {}

    def ask():
        try:
            box["out"] = client.run(_pause_fraction, workers=[addr], on_error="return")[addr]
        except Exception:  # noqa: BLE001 - unknown
            pass

    t = threading.Thread(target=ask, daemon=True, name="dagrl-pause-fraction")
    t.start()
    t.join(timeout)
    out = box.get("out")
    return out if isinstance(out, (int, float)) else None
