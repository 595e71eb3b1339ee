"""A sweep's jobs side by side (`python -m pipelines.run -m --jobs N ...`, pipelines.sweep_jobs): the flag, the refusal
on a cluster the driver starts itself, the slots (pinned one job a device where the placement planner fits it, else
shared), the job processes (more jobs than slots wait, a failed job does not stop the others, a Ctrl-C passed on to
the running jobs), the worker-resident plugin a second driver keeps, and one real two-job sweep side by side on an
existing cluster the test starts (cluster tier)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pipelines import run, sweep, sweep_jobs
from pipelines.cli import UsageError
from pipelines.sweep_jobs import Slot


# ----- the flag and the refusal -----
@pytest.mark.parametrize("words, n", [(["-m", "--jobs", "3", "seed=1,2"], 3), (["--jobs=2", "-m"], 2),
                                      (["-j", "4"], 4), (["-j2", "a=1"], 2), (["-m", "a=1"], None)])
def test_jobs_flag_takes_its_spellings_and_leaves_the_rest(words, n):
    rest, got = sweep_jobs.jobs_flag(words)
    assert got == n
    assert rest == [w for w in words if w not in ("--jobs", "-j", str(n)) and not w.startswith(("--jobs=", "-j"))]


@pytest.mark.parametrize("words", [["-j", "0"], ["--jobs=x"], ["-m", "--jobs"], ["-j", "-m"]])
def test_a_bad_jobs_value_is_one_line(words):
    with pytest.raises(UsageError, match="--jobs|-j"):
        sweep_jobs.jobs_flag(words)


def _lines(capsys):
    cap = capsys.readouterr()
    return cap.out, [ln for ln in cap.err.splitlines() if ln.strip() and not ln.startswith("note: ")]


def test_jobs_on_the_embedded_cluster_is_refused_naming_the_fix(capsys, tmp_path, monkeypatch):
    import pipelines.clusters

    def refuse(cfg):
        raise AssertionError("a cluster was started")
    monkeypatch.setattr(pipelines.clusters, "start_cluster", refuse)
    rc = run.main(["-m", "-j", "2", "conf=smoke", "seed=1,2", f"run_root={tmp_path}"])
    _, err = _lines(capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --jobs 2:"), err
    assert "cluster=address" in err[0] and "cluster.kind=local" in err[0] and "leave out --jobs" in err[0]
    assert not any(tmp_path.iterdir())  # no sweep directory, no store
    rc = run.main(["-j", "2", "conf=smoke", f"run_root={tmp_path}"])  # without -m
    _, err = _lines(capsys)
    assert rc == 2 and len(err) == 1 and "add -m" in err[0], err


def test_jobs_at_two_addresses_are_refused():
    class C:
        def __init__(self, address):
            self.cluster = type("K", (), {"kind": "address", "address": address})()
    assert sweep_jobs.refusal([C("tcp://a:1"), C("tcp://a:1")], 2) is None
    line = sweep_jobs.refusal([C("tcp://a:1"), C("tcp://b:1")], 2)
    assert line.startswith("error: --jobs 2: the jobs name 2 cluster.address values") and "tcp://b:1" in line


# ----- the slots -----
def _info(env_hosts, gpu_hosts):
    """A scheduler's view: env workers env-i (CPU=1) and GPU workers gpu-i (GPU=1) on the given hosts."""
    workers = {f"tcp://{h}:{100 + i}": {"name": f"env-{i}", "resources": {"CPU": 1}} for i, h in enumerate(env_hosts)}
    workers.update({f"tcp://{h}:{200 + i}": {"name": f"gpu-{i}", "resources": {"GPU": 1}}
                    for i, h in enumerate(gpu_hosts)})
    return {"address": "tcp://s:1", "workers": workers}


@pytest.fixture(scope="module")
def address_cfg():
    from pipelines.config import load_config
    return load_config(["conf=smoke", "cluster=address", "cluster.address=tcp://127.0.0.1:8786"], command="run")[0]


def test_slots_pin_one_job_a_device_where_each_device_holds_one(address_cfg):
    # two GPU workers, each served by its own env worker (round-robin on one host): both devices fit a job
    info = _info(["h", "h"], ["h", "h"])
    assert sweep_jobs.devices_that_fit(address_cfg, info) == [0, 1]
    slots = sweep_jobs.plan_slots(3, [0, 1])
    assert [s.device for s in slots] == [0, 1, 0]  # more slots than devices: round-robin
    job = sweep.Job(0, ["conf=smoke", "cluster=address", "cluster.address=tcp://127.0.0.1:8786", "seed=1"], {})
    overrides, cfg = sweep_jobs.slot_config(job, address_cfg, slots[1], info)
    assert overrides[-1] == sweep_jobs.placement_override(1)
    from pipelines.clusters import plan_placement
    p = plan_placement(cfg, info)
    gpu1 = next(a for a, w in info["workers"].items() if w["name"] == "gpu-1")
    env1 = next(a for a, w in info["workers"].items() if w["name"] == "env-1")
    assert p.actor_worker == gpu1 and set(p.shard_workers) == {env1}  # only device 1's workers


def test_slots_share_the_workers_where_devices_cannot_each_hold_a_job(address_cfg):
    import dataclasses
    # one env worker for two GPU workers: it serves device 0 only, so a job pinned to device 1 has no env worker
    assert sweep_jobs.devices_that_fit(address_cfg, _info(["h"], ["h", "h"])) == [0]
    assert sweep_jobs.devices_that_fit(address_cfg, _info(["h", "h"], ["h"])) == []  # one device
    two_ranks = dataclasses.replace(address_cfg, algorithm=dataclasses.replace(address_cfg.algorithm,
                                                                                num_actor_ranks=2))
    assert not sweep_jobs.pins(two_ranks)
    assert sweep_jobs.devices_that_fit(two_ranks, _info(["h", "h"], ["h", "h"])) == []
    assert [s.device for s in sweep_jobs.plan_slots(2, [0])] == [None, None]
    # a shared slot keeps the job's own overrides; its placement is still checked against the live workers
    job = sweep.Job(0, ["seed=1"], {})
    assert sweep_jobs.slot_config(job, address_cfg, Slot(0, None), _info(["h"], ["h"]))[0] == ["seed=1"]
    from tasks.config import ConfigError
    with pytest.raises(ConfigError, match="none with resource CPU"):
        sweep_jobs.slot_config(job, address_cfg, Slot(0, None), _info([], ["h"]))


# ----- the job processes (stand-ins for the drivers: small python processes) -----
_FAKE_JOB = r"""
import json, signal, sys, time
spec = json.load(open(sys.argv[1]))
seed = int(spec["overrides"][-1].split("=")[1])
rec = spec["record"]
json.dump({"run_id": f"r{seed}"}, open(rec, "w"))
open(rec + ".t", "w").write(f"{time.time()}\n")
signal.signal(signal.SIGINT, lambda *a: (print("interrupted (SIGINT) at step 1: checkpointed"), sys.exit(130)))
print(f"job seed {seed}", flush=True)
time.sleep({"1": 1.0, "2": 0.2, "3": 1.0, "4": 0.3}.get(str(seed), 30))
open(rec + ".t", "a").write(f"{time.time()}\n")
if seed == 2:
    print("error: training step 1: a stand-in failure", flush=True)
    sys.exit(1)
"""


class _Client:
    def __init__(self):
        self.released, self.closed = [], False

    def run(self, fn, prefix, on_error=None):
        self.released.append(prefix)

    def close(self):
        self.closed = True


@pytest.fixture
def fake_jobs(monkeypatch, tmp_path):
    """run_side_by_side with each job a small python process (`_FAKE_JOB`) and no placement check."""
    script = tmp_path / "fake_job.py"
    script.write_text(_FAKE_JOB)
    monkeypatch.setattr(sweep_jobs, "slot_config", lambda job, cfg, slot, info: (list(job.overrides), cfg))
    real_popen = subprocess.Popen

    def popen(args, **kw):
        return real_popen([sys.executable, str(script), args[-1]], **kw)
    monkeypatch.setattr(sweep_jobs.subprocess, "Popen", popen)
    monkeypatch.setattr("pipelines.clusters.cluster_info", lambda client: {})

    def go(seeds, n):
        jobs, keys = sweep.expand([f"seed={','.join(map(str, seeds))}"])
        s = sweep.Sweep("S", [], keys, jobs, run_root=str(tmp_path))
        where = tmp_path / "sweeps" / "S"
        cfg = type("C", (), {"experiment": "e", "cluster": type("K", (), {"address": "tcp://x:1"})()})()
        client = _Client()
        out = []
        rc = sweep_jobs.run_side_by_side(s, where, [cfg] * len(jobs), client, sweep_jobs.plan_slots(n, []),
                                         job_tags=sweep.job_tags, summary=sweep.summary,
                                         echo=lambda *a, **k: out.append(" ".join(map(str, a))))
        spans = {}
        for j in jobs:
            t = where / f"job-{j.index}.record.json.t"
            if t.exists():
                spans[j.swept["seed"]] = [float(x) for x in t.read_text().split()]
        return rc, sweep.Sweep.read(where / "sweep.json"), spans, out, client
    return go


def test_more_jobs_than_slots_wait_and_a_failed_job_does_not_stop_the_others(fake_jobs):
    rc, rec, spans, out, client = fake_jobs([1, 2, 3, 4], 2)
    assert rc == 1 and rec.status == "failed" and client.closed
    assert [j.status for j in rec.jobs] == ["finished", "failed", "finished", "finished"]
    assert [j.exit_code for j in rec.jobs] == [0, 1, 0, 0]
    assert rec.jobs[1].reason == "error: training step 1: a stand-in failure"  # its log's one line
    assert [j.run_id for j in rec.jobs] == ["r1", "r2", "r3", "r4"] and sorted(client.released) == [
        "r1/", "r2/", "r3/", "r4/"]
    # never more than two at once, and jobs 0 and 1 ran side by side
    events = sorted([(s, 1) for s, _ in spans.values()] + [(e, -1) for _, e in spans.values()])
    at_once = max(sum(d for _, d in events[:i + 1]) for i in range(len(events)))
    assert at_once == 2
    assert spans["1"][0] < spans["2"][1] and spans["2"][0] < spans["1"][1]
    assert spans["3"][0] >= spans["2"][1]  # job 2 (seed=3) waited for the slot seed=2 freed
    assert sum("started" in ln for ln in out) == 4 and sum("finished:" in ln for ln in out) == 3


def _ctrl_c_once_both_jobs_run(where, stop: threading.Event) -> None:
    """SIGINT to this process once the sweep's handler is installed here and both jobs have installed theirs (they
    print their seed after it): a SIGINT before then would reach pytest itself, or kill a job outright."""
    logs = [where / "job-0.log", where / "job-1.log"]
    while not stop.wait(0.05):
        handler = signal.getsignal(signal.SIGINT)
        if (isinstance(getattr(handler, "__self__", None), sweep_jobs._Forward)
                and all(p.exists() and "job seed" in p.read_text() for p in logs)):
            os.kill(os.getpid(), signal.SIGINT)
            return


def test_ctrl_c_is_passed_on_to_the_running_jobs_and_the_rest_do_not_run(fake_jobs, tmp_path):
    # seeds 5 and 6 sleep 30 s unless interrupted; seed 7 waits for a slot and never starts
    stop = threading.Event()
    sender = threading.Thread(target=_ctrl_c_once_both_jobs_run, args=(tmp_path / "sweeps" / "S", stop))
    sender.start()
    t0 = time.perf_counter()
    try:
        rc, rec, spans, out, _ = fake_jobs([5, 6, 7], 2)
    finally:
        stop.set()
        sender.join()
    assert rc == 130 and rec.status == "interrupted" and time.perf_counter() - t0 < 20
    assert [j.status for j in rec.jobs] == ["interrupted", "interrupted", "not run"]
    assert [j.exit_code for j in rec.jobs] == [130, 130, None]
    assert rec.jobs[0].reason.startswith("interrupted (SIGINT)")
    assert set(spans) == {"5", "6"}


def test_the_child_without_a_job_file_is_one_line(capsys, tmp_path):
    from pipelines.run import sweep_job_main
    assert sweep_job_main([str(tmp_path / "missing.json")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "python -m pipelines.run -m --jobs N" in err[0]


# ----- one real sweep side by side on an existing cluster (cluster tier) -----
@pytest.fixture
def existing_cluster():
    """A cluster this test starts, laid out as the embedded one (pipelines.clusters.local.cluster_specs): env-0 and
    env-1 (CPU=1), gpu-0 and gpu-1 (GPU=1, logical), each a Nanny process."""
    from distributed import SpecCluster

    from pipelines.clusters.local import cluster_specs, glibc_malloc_defaults
    from pipelines.config import load_config
    cfg = load_config(["conf=smoke", "cluster.num_env_workers=2", "cluster.dashboard_address=127.0.0.1:0"],
                      command="run")[0]
    glibc_malloc_defaults()
    scheduler, workers = cluster_specs(cfg, [("gpu-0", None), ("gpu-1", None)])
    with SpecCluster(workers=workers, scheduler=scheduler, asynchronous=False) as c:
        yield c


@pytest.mark.cluster
def test_two_smoke_jobs_run_side_by_side_on_one_existing_cluster(existing_cluster, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from storage.tracking import SWEEP_TAG, SWEPT_TAG_PREFIX, default_tracking_uri
    addr = existing_cluster.scheduler_address
    rc = run.main(["-m", "--jobs", "2", "conf=smoke", "cluster=address", f"cluster.address={addr}",
                   "runner.max_steps=2", f"run_root={tmp_path}", "seed=1,2"])
    out = capsys.readouterr().out
    (path,) = (tmp_path / "sweeps").glob("*/sweep.json")
    rec = json.loads(path.read_text())
    logs = {p.name: p.read_text()[-3000:] for p in path.parent.glob("job-*.log")}
    assert rc == 0, (out, logs)
    assert [j["status"] for j in rec["jobs"]] == ["finished", "finished"] and rec["status"] == "finished"
    assert [j["exit_code"] for j in rec["jobs"]] == [0, 0]
    assert rec["extra"]["slots"] == ["slot 0, device 0", "slot 1, device 1"]  # two GPU workers: one job each
    assert sum(" started: " in ln for ln in out.splitlines()) == 2  # one line per job start on the sweep's console
    client = MlflowClient(default_tracking_uri(tmp_path))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`{SWEEP_TAG}` = '{rec['sweep_id']}'")
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    assert sorted(r.data.tags[f"{SWEPT_TAG_PREFIX}seed"] for r in runs) == ["1", "2"]
    assert sorted(r.data.tags[sweep.JOB_TAG] for r in runs) == ["0", "1"]
    assert {r.data.tags["dagrl.run_id"] for r in runs} == {j["run_id"] for j in rec["jobs"]}
    # each job on its own device: the placement its driver was given is in its resolved config
    by_seed = {r.data.params["seed"]: r for r in runs}
    assert {s: by_seed[s].data.params.get("cluster.component_placement.actor") for s in ("1", "2")} == {
        "1": "0", "2": "1"}
    # side by side: each run started before the other one ended
    a, b = (r.info for r in runs)
    assert a.start_time < b.end_time and b.start_time < a.end_time
    from pipelines import compare  # the sweep's report reads them as a sweep's runs
    assert compare.main(["--sweep", rec["sweep_id"], "--run-root", str(tmp_path)]) == 0
    assert "(all runs): 2 seed(s) (1, 2)" in capsys.readouterr().out


@pytest.mark.cluster
def test_a_run_on_an_existing_cluster_closes_its_resident_objects_when_it_ends(existing_cluster, tmp_path):
    """The workers' resident plugin is shared by every driver (never re-registered), so a run on a cluster that
    outlives it closes its own env shards, actor and replicas (keys `<run_id>/...`) at its end: nothing of it stays
    in the workers' memory, and what another driver's run holds stays."""
    from distributed import Client

    from tasks import resident
    addr = existing_cluster.scheduler_address
    with Client(addr) as other:
        resident.install(other)
        other.submit(resident.put, "otherrun/actor", 1, pure=False).result()
        assert run.main(["conf=smoke", "cluster=address", f"cluster.address={addr}", "runner.max_steps=1",
                         f"run_root={tmp_path}"]) == 0
        (run_dir,) = (tmp_path / "smoke").iterdir()
        held = {k for keys in other.run(resident.keys).values() for k in keys}
        assert not any(k.startswith(f"{run_dir.name}/") for k in held), held
        assert "otherrun/actor" in held


@pytest.mark.cluster
def test_a_second_driver_keeps_the_first_ones_resident_objects():
    """Two drivers on one cluster each install the registry (`pipelines.clusters.start_cluster`): the second
    install leaves the plugin, and the objects the first driver's run holds, in place."""
    from distributed import Client, LocalCluster

    from tasks import resident

    class Held:
        closed = 0

        def close(self):
            Held.closed += 1
    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as c, Client(c) as first:
        resident.install(first)
        first.submit(resident.put, "runA/actor", Held(), pure=False).result()
        with Client(c.scheduler_address) as second:
            resident.install(second)
            (keys,) = second.run(resident.keys).values()
        assert keys == ["runA/actor"] and Held.closed == 0
