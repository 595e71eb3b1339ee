"""tasks.resident: worker-resident objects in the `Resident` worker plugin (Dask's public plugin API), with the
process-local fallback outside workers.

An in-process LocalCluster (threads, 2 workers; ~3 s) so that the test can see what each worker's plugin holds
and what was closed: objects created by a task live in that worker's plugin only, `Client.run(resident.release)`
releases them there (recovery's call), a worker joining later gets the plugin, and closing a worker closes its
objects (teardown).
"""
from __future__ import annotations

import time

import pytest
from distributed import Client, LocalCluster

from tasks import resident

CLOSED: list[str] = []


class Thing:
    def __init__(self, name: str):
        self.name = name

    def close(self):
        CLOSED.append(self.name)


def _make(key: str) -> tuple[str, bool]:
    value, created = resident.get_or_create(key, lambda: Thing(key))
    return value.name, created


def test_process_local_fallback_without_dask():
    resident.release("fb/")
    CLOSED.clear()
    a, created = resident.get_or_create("fb/a", lambda: Thing("fb/a"))
    assert created and resident.get("fb/a") is a
    again, created = resident.get_or_create("fb/a", lambda: Thing("other"))
    assert again is a and not created
    resident.put("fb/b", 3)  # no close(): just dropped
    assert {"fb/a", "fb/b"} <= set(resident.keys()) and "fb/a" in resident._RESIDENT
    assert resident.release("fb/") == 2 and CLOSED == ["fb/a"] and resident.get("fb/a") is None


@pytest.fixture
def cluster():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0") as lc, \
            Client(lc) as client:
        resident.install(client)
        yield lc, client


def test_objects_live_in_their_workers_plugin(cluster):
    lc, client = cluster
    CLOSED.clear()
    a, b = sorted(client.scheduler_info()["workers"])
    assert client.submit(_make, "run/shard/0", workers=[a], pure=False).result() == ("run/shard/0", True)
    assert client.submit(_make, "run/shard/0", workers=[a], pure=False).result() == ("run/shard/0", False)
    assert client.submit(_make, "run/shard/1", workers=[b], pure=False).result() == ("run/shard/1", True)
    assert client.submit(_make, "run/actor", workers=[b], pure=False).result() == ("run/actor", True)
    assert client.run(resident.keys) == {a: ["run/shard/0"], b: ["run/actor", "run/shard/1"]}
    assert not any(k.startswith("run/") for k in resident._RESIDENT)  # nothing in the process-local dict
    with pytest.raises(RuntimeError, match="ambiguous"):  # outside a task, two in-process workers
        resident.get("run/actor")
    # recovery's call: release the shards on every worker, nothing else
    assert client.run(resident.release, "run/shard/") == {a: 1, b: 1}
    assert sorted(CLOSED) == ["run/shard/0", "run/shard/1"]
    assert client.run(resident.keys) == {a: [], b: ["run/actor"]}
    # a worker that joins later gets the plugin (a restarted one too: the scheduler keeps it)
    lc.scale(3)
    client.wait_for_workers(3)
    (c,) = set(client.scheduler_info()["workers"]) - {a, b}
    assert client.submit(_make, "run/shard/2", workers=[c], pure=False).result() == ("run/shard/2", True)
    assert client.run(resident.keys, workers=[c]) == {c: ["run/shard/2"]}
    # a closing worker closes its objects (the plugin's teardown)
    CLOSED.clear()
    client.retire_workers([b], close_workers=True)
    deadline = time.monotonic() + 30
    while not CLOSED and time.monotonic() < deadline:  # the worker closes after retire_workers returns
        time.sleep(0.05)
    assert CLOSED == ["run/actor"]


def test_worker_without_the_plugin_keeps_the_process_local_registry():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0") as lc, \
            Client(lc) as client:
        resident.release("np/")
        assert client.submit(_make, "np/x", pure=False).result() == ("np/x", True)
        assert "np/x" in resident._RESIDENT  # as before the plugin: a process-global registry
        assert resident.release("np/") == 1


def _release_without_worker_argument(prefix: str) -> int:
    """As tasks.actor.distributed.release_group: calls resident.release without `dask_worker` (through Client.run)."""
    return resident.release(prefix)


def test_client_run_without_dask_worker_uses_the_process_one_plugin():
    """One worker per process (the embedded cluster's layout): a Client.run function that does not take
    `dask_worker` still acts on that worker's plugin, not on the process-local dict."""
    CLOSED.clear()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0") as lc, \
            Client(lc) as client:
        resident.install(client)
        (a,) = client.scheduler_info()["workers"]
        assert client.submit(_make, "one/group", pure=False).result() == ("one/group", True)
        assert "one/group" not in resident._RESIDENT
        assert client.run(_release_without_worker_argument, "one/") == {a: 1}
        assert CLOSED == ["one/group"] and client.run(resident.keys) == {a: []}
    assert not resident._SET_UP  # torn down with its worker
