"""tests/conftest.py's pool of embedded clusters (one cluster per layout), on fakes: a later start of the same layout,
simulator and environment gets the kept workers with the earlier runs' resident objects dropped; a worker that
changed, a plugin a test registered, another environment variable or another layout gets a new cluster, with two
layouts kept at most (the least recently used closed first); the handles given out do not close the kept cluster."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest


@dataclasses.dataclass
class _Cluster:
    kind: str = "local"
    num_env_workers: int = 2


class _Client:
    def __init__(self):
        self.state = ([("env-0", "running"), ("env-1", "running")], ["dagrl-resident"], [])
        self.ran: list[tuple] = []

    def run_on_scheduler(self, fn):
        assert fn.__name__ == "_scheduler_state"
        return self.state

    def run(self, fn, *args, **kwargs):
        self.ran.append((fn.__name__, args))


class _Handle:
    def __init__(self):
        self.client, self.cluster, self.dashboard_link, self.note = _Client(), object(), "http://x", "a note"
        self.closed = False

    def close(self):
        self.closed = True


@pytest.fixture()
def pool(cluster_pool_parts):
    p = cluster_pool_parts[0]()
    started: list[_Handle] = []

    def real(cfg):
        started.append(_Handle())
        return started[-1]
    yield p, real, started
    p.close()


def _cfg(**cluster):
    return SimpleNamespace(cluster=_Cluster(**cluster), env=SimpleNamespace(simulator="maniskill"))


def test_the_same_layout_gets_the_kept_workers_with_resident_objects_dropped(pool):
    p, real, started = pool
    first = p.start(real, _cfg())
    second = p.start(real, _cfg())
    assert len(started) == 1
    assert first.client is second.client is started[0].client
    assert first.note == "a note" and second.note is None  # said once, when the cluster came up
    assert started[0].client.ran == [("release", ("",))]  # before the second run only
    second.close()
    assert not started[0].closed  # a run's close leaves the kept cluster up


def test_a_changed_worker_or_a_registered_plugin_gets_a_new_cluster(pool):
    p, real, started = pool
    p.start(real, _cfg())
    started[0].client.state = ([("env-0", "running"), ("env-1", "paused")], ["dagrl-resident"], [])
    p.start(real, _cfg())
    assert len(started) == 2 and started[0].closed
    started[1].client.state = ([("env-0", "running"), ("env-1", "running")], ["dagrl-resident", "nan-actions"], [])
    p.start(real, _cfg())
    assert len(started) == 3 and started[1].closed and not started[2].closed


def test_another_environment_or_layout_gets_a_new_cluster_and_the_least_recently_used_is_closed(pool, monkeypatch):
    p, real, started = pool
    assert p.KEEP == 2
    p.start(real, _cfg())
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")  # pytest's own: no new cluster
    monkeypatch.setenv("PYTHONHASHSEED", "6640")  # what distributed sets when it starts workers
    p.start(real, _cfg())
    assert len(started) == 1
    monkeypatch.setenv("DAGRL_SOME_SETTING", "1")  # the workers would inherit it: layout B
    p.start(real, _cfg())
    assert len(started) == 2 and not started[0].closed  # two kept
    p.start(real, _cfg())  # B again: kept, and now the most recently used
    monkeypatch.delenv("DAGRL_SOME_SETTING")
    p.start(real, _cfg())  # A again: still kept
    assert len(started) == 2 and not any(h.closed for h in started)
    p.start(real, _cfg(num_env_workers=3))  # C: closes B, the least recently used
    assert len(started) == 3 and started[1].closed and not started[0].closed
    p.close()
    assert all(h.closed for h in started)


def test_the_vulkan_icd_the_env_workers_get_anyway_is_no_new_environment(pool, monkeypatch):
    """A sim test sets this process's VK_ICD_FILENAMES (`ensure_vulkan`) to the ICD `worker_env` gives the env
    workers anyway: the same layout; another ICD is another environment."""
    from tasks.envs import worker_env
    p, real, started = pool
    monkeypatch.delenv("VK_ICD_FILENAMES", raising=False)
    monkeypatch.delenv("VK_DRIVER_FILES", raising=False)
    icd = worker_env(_cfg().env).get("VK_ICD_FILENAMES")
    if icd is None:
        pytest.skip("a system Vulkan driver: the env workers get no VK_ICD_FILENAMES")
    p.start(real, _cfg())
    monkeypatch.setenv("VK_ICD_FILENAMES", icd)
    p.start(real, _cfg())
    assert len(started) == 1
    monkeypatch.setenv("VK_ICD_FILENAMES", icd + ".other.json")
    p.start(real, _cfg())
    assert len(started) == 2
