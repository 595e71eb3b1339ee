"""benchmarks/throughput.py's machine bound and actor-thread rule (the arithmetic its report prints), no runs."""
import os

import pytest

from tasks.config import Config


@pytest.fixture(scope="module")
def tp(load_benchmark):
    return load_benchmark("throughput")


def test_machine_bound_adds_the_update_cpu_to_the_raw_simulator(tp):
    # 1600 env steps at 1657 steps/s on 2 cores = 0.966 s wall = 1.931 CPU-s; + 0.84 CPU-s update = 2.771 CPU-s
    # over 2 cores = 1.386 s per step -> 1155 steps/s (benchmarks/README.md's hand arithmetic for 2026-11-29)
    assert tp.machine_bound(1600, 1657.0, 0.84, 2) == pytest.approx(1600 / ((1600 / 1657 * 2 + 0.84) / 2))
    assert round(tp.machine_bound(1600, 1657.0, 0.84, 2)) == 1155
    assert tp.machine_bound(1600, 1657.0, 0.0, 2) == pytest.approx(1657.0)  # no update: the raw rate itself
    # more cores share the same update CPU time: the bound rises towards raw
    assert tp.machine_bound(1600, 1657.0, 0.84, 16) > tp.machine_bound(1600, 1657.0, 0.84, 2)


def test_actor_threads_follow_the_cluster_rule(tp, monkeypatch):
    cfg = Config()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert tp.actor_threads(cfg) == 1  # 2 cores - 2 env workers, at least 1
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert tp.actor_threads(cfg) == 14
    cfg.cluster.actor_threads = 2
    assert tp.actor_threads(cfg) == 2
