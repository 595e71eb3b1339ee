"""Stateful things resident on a worker: env shards, policy replicas, the actor, process groups.

Graph nodes that need such state are pinned to the worker holding it (pipelines.graphs). A node that finds its
entry missing (a fresh worker after a loss) rebuilds it from its arguments (cursor, weights, checkpoint), so a lost
worker costs a re-created shard and a retried step, never wrong data.

Where the registry lives (Dask's public worker-plugin API):
- On a Dask worker that has the `Resident` plugin (`install(client)`: the driver registers it once with
  `Client.register_plugin`; the scheduler gives it to every worker that joins later, restarted ones included):
  the plugin instance's `objects`, found through `distributed.get_worker().plugins[PLUGIN]`. When the worker
  closes (cluster shutdown, `restart_workers`, a nanny stopping it) `Resident.teardown` closes every entry that
  has `close()` (env shards: their simulators; process groups: destroyed). A worker process that is killed
  outright gets no teardown; its objects go with the process.
- Everywhere else, a process-local dict (`_RESIDENT`): task functions called directly (tests, the synchronous
  scheduler `dask.get`), spawned torch.distributed rank processes, a worker of a cluster the driver did not
  install the plugin on, or code running outside a task's context on a worker (a thread the task started). So
  tasks stay testable without Dask, and on a worker process without the plugin the behaviour is that of a
  process-global registry (one worker per process in the embedded cluster).

Functions run with `Client.run` (e.g. recovery's `client.run(resident.release, prefix)`,
`tasks.actor.distributed.release_group`) execute outside a task, where `get_worker()` has no worker: `release` and `keys`
take the `dask_worker` argument `Client.run` passes to functions that declare it; any other call outside a task
uses the plugin set up in this process when there is exactly one (a worker process of the embedded cluster), the
process-local dict when there is none, and raises RuntimeError when several in-process workers make it ambiguous.
"""
from __future__ import annotations

from typing import Any, Callable

from distributed.diagnostics.plugin import WorkerPlugin

PLUGIN = "dagrl-resident"  # the plugin's name on every worker
_RESIDENT: dict[str, Any] = {}  # the process-local fallback registry (module docstring)
_SET_UP: list["Resident"] = []  # the plugins set up in this process (one per worker living here)


class Resident(WorkerPlugin):
    """The worker's registry of resident objects (`objects`: key -> object); closes them at worker teardown."""

    name = PLUGIN
    idempotent = True  # Dask's: registering it again under this name is a no-op on the scheduler (`install`)

    def __init__(self):
        self.objects: dict[str, Any] = {}

    def setup(self, worker) -> None:
        self.objects = {}
        _SET_UP.append(self)

    def teardown(self, worker) -> None:
        if self in _SET_UP:
            _SET_UP.remove(self)
        _close_all(self.objects, list(self.objects))


def install(client) -> None:
    """Register the `Resident` plugin on every worker of `client`'s cluster, present and future, unless the
    scheduler has it already (`Resident.idempotent`: a second driver on a shared cluster, e.g. a sweep's jobs side
    by side, keeps the plugin and the objects the first one's runs hold; a re-registration would replace the
    plugin and close them)."""
    client.register_plugin(Resident(), name=PLUGIN)


def _registry(dask_worker=None) -> dict[str, Any]:
    """The registry of this context (module docstring): the worker plugin's (given `dask_worker`, or the worker
    running this task), else the one plugin set up in this process, else the process-local dict.

    Raises:
        RuntimeError: outside a task in a process holding several workers with the plugin (pass `dask_worker`).
    """
    worker = dask_worker
    if worker is None:
        from distributed import get_worker
        try:
            worker = get_worker()
        except ValueError:  # not inside a worker task
            if len(_SET_UP) > 1:
                raise RuntimeError(f"tasks.resident outside a task with {len(_SET_UP)} in-process workers: which "
                                   "worker's objects is ambiguous; call it through Client.run with a `dask_worker` "
                                   "argument, or from a task") from None
            return _SET_UP[0].objects if _SET_UP else _RESIDENT
    plugin = getattr(worker, "plugins", {}).get(PLUGIN)
    return plugin.objects if isinstance(plugin, Resident) else _RESIDENT


def get_or_create(key: str, factory: Callable[[], Any]) -> tuple[Any, bool]:
    """Return (value, created) for `key`, building it with `factory()` when absent."""
    reg = _registry()
    if key in reg:
        return reg[key], False
    value = factory()
    reg[key] = value
    return value, True


def get(key: str, default: Any = None) -> Any:
    """The resident object under `key`, or `default`."""
    return _registry().get(key, default)


def put(key: str, value: Any) -> None:
    """Make `value` resident under `key` (replacing, without closing, what was there)."""
    _registry()[key] = value


def release(prefix: str, dask_worker=None) -> int:
    """Drop (and close, when they have `close()`) every entry whose key starts with `prefix`; return the count.
    `dask_worker`: given by `Client.run` (module docstring); tasks leave it out."""
    reg = _registry(dask_worker)
    keys_ = [k for k in reg if k.startswith(prefix)]
    _close_all(reg, keys_, swallow=False)
    return len(keys_)


def release_on(client, prefix: str) -> None:
    """From a driver: `release(prefix)` on every worker of `client`'s cluster, once a run, eval or recording whose
    keys start with `prefix` has ended (a cluster that outlives it, `cluster.address`, would keep its objects: the
    plugin is shared, never re-registered). A cluster that no longer answers is left alone (its workers went with
    it)."""
    try:
        client.run(release, prefix, on_error="ignore")
    except Exception:  # noqa: BLE001 - the command's result stands; a gone cluster holds nothing
        pass


def keys(dask_worker=None) -> list[str]:
    """The resident keys of this context, sorted (`dask_worker` as for `release`)."""
    return sorted(_registry(dask_worker))


def _close_all(reg: dict[str, Any], keys_: list[str], swallow: bool = True) -> None:
    """Pop `keys_` from `reg` and close each value that has `close()`. With `swallow` (worker teardown) a failing
    close does not stop the others; without it, the first error propagates after its entry was dropped."""
    for k in keys_:
        value = reg.pop(k)
        close = getattr(value, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                if not swallow:
                    raise


def memory_limit_bytes(limit: Any) -> int | None:
    """`cluster.memory_limit` in bytes (a Dask size string such as "3GiB", or a number of bytes); None when a
    worker has no limit ("auto" sizes it from the machine at start: unknown offline; None or 0: unlimited).

    Raises:
        ValueError: a string Dask cannot parse as a size."""
    if limit in (None, 0, "0", "auto"):
        return None
    from dask.utils import parse_bytes
    return parse_bytes(limit) if isinstance(limit, str) else int(limit)


def memory_bound() -> tuple[float, str]:
    """The fraction of a worker's memory limit what it holds may reach, and what that fraction is: Dask pauses a
    worker at `distributed.worker.memory.pause` (default 0.8; a paused worker runs nothing, and a paused env worker
    stalls the step) and its nanny restarts it at `distributed.worker.memory.terminate` (0.95); the lower one that
    is set."""
    import dask
    bounds = [(float(dask.config.get(f"distributed.worker.memory.{k}", None) or 0), k) for k in ("pause", "terminate")]
    set_ = [(f, k) for f, k in bounds if 0 < f <= 1]
    return min(set_) if set_ else (1.0, "limit")
