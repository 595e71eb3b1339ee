"""`cluster.kind=slurm` (pipelines/clusters/slurm.py, jobqueue.py).

Default suite (no Slurm needed): the job scripts a config asks for (directives, worker resources, names, the
environment lines), Slurm's time formats, the refusals before submission (walltime shorter than
runner.max_wall_time_s, an unknown partition and more GPUs per job than a node has as sinfo reports them), the
waiting's timeout line naming the pending jobs and squeue's reason, the job watch re-submitting a job that left the
queue, and `pipelines.validate cluster=slurm` printing the job scripts.

Slow suite (`cluster` tier), on the real one-node Slurm of conftest.py (`slurm_queue`: no job left in squeue after
each test): `python -m pipelines.run conf=smoke cluster=slurm` through sbatch jobs plays the same evaluation
episodes as `cluster=local` with the same seeds; an env worker's job cancelled with `scancel` mid-run is replaced
and the run finishes with the store's steps and MLflow's steps each exactly once; the actor's job cancelled mid-run
is replaced and the actor restored from the last checkpoint, said in one line naming the job and how to resume.
"""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelines.clusters import slurm
from pipelines.clusters.errors import PlacementError
from pipelines.clusters.jobqueue import JobWatch, QueueState, wait_for_jobs
from pipelines.config import load_config
from tasks.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def _cfg(*overrides: str, tmp_path=None):
    cfg, _ = load_config(["cluster=slurm", *overrides, *([f"run_root={tmp_path}"] if tmp_path else [])])
    return cfg


def _directives(script: str) -> list[str]:
    return [ln[len("#SBATCH "):] for ln in script.splitlines() if ln.startswith("#SBATCH ")]


def _worker_command(script: str) -> str:
    return script.rstrip().splitlines()[-1]


# ----- the job scripts -----

def test_job_scripts_follow_the_placement_and_the_keys(tmp_path):
    """2 env jobs (CPU=1 workers) and 2 GPU jobs of 2 real GPUs (gres, dask cuda worker, GPU=1 per worker), each
    with the partition, account, walltime, cores, memory (per worker x workers), extra directives, the venv's
    activation and the workers' thread settings."""
    cfg = _cfg("cluster.num_env_workers=2", "cluster.gpu_jobs=2", "cluster.gpus_per_job=2", "cluster.gpu_nodes=true",
               "cluster.gpu_job_cores=6", "cluster.env_job_cores=3", "cluster.partition=gpu", "cluster.account=lab",
               "cluster.walltime=02:30:00", "cluster.memory_limit=2GiB", "cluster.job_extra_directives=['--qos=high']",
               tmp_path=tmp_path)
    scripts = dict(slurm.job_scripts(cfg))
    assert list(scripts) == ["env-0", "env-1", "gpu-0", "gpu-1"]
    logs = slurm.log_directory(cfg)
    assert logs == str(tmp_path / "slurm-logs")
    for name, script in scripts.items():
        d = _directives(script)
        gpu = name.startswith("gpu")
        assert {"-p gpu", "-A lab", "-t 02:30:00", "--qos=high", f"-J dagrl-{name}"} <= set(d), d
        assert f"-o {logs}/%x-%j.out" in d and f"-e {logs}/%x-%j.err" in d
        assert f"--cpus-per-task={6 if gpu else 3}" in d
        assert f"--mem={4 if gpu else 2}G" in d  # memory_limit per worker, 2 workers in a GPU job
        assert ("--gres=gpu:2" in d) == gpu
        cmd = _worker_command(script)
        assert f"--name {name}" in cmd and f"--resources {'GPU' if gpu else 'CPU'}=1" in cmd
        assert ("-m dask cuda worker" in cmd) == gpu  # one worker per GPU, by dask-cuda
        assert cmd.startswith(sys.executable)
        assert f"source {sys.prefix}/bin/activate" in script or sys.prefix == sys.base_prefix
        threads = 6 // 2 if gpu else 1  # a GPU worker's torch threads: the job's cores over its GPUs
        assert f"export OMP_NUM_THREADS={threads}" in script


def test_logical_gpus_are_plain_workers_one_per_gpu():
    """Without GPU nodes a GPU job asks for no gres and starts `gpus_per_job` plain workers (dask worker
    --nworkers) carrying the logical GPU resource, named gpu-j-k; the devices are jobs x GPUs per job."""
    cfg = _cfg("cluster.gpu_jobs=1", "cluster.gpus_per_job=2", "cluster.gpu_job_cores=2")
    jobs = {j.name: j for j in slurm.job_specs(cfg)}
    assert jobs["gpu-0"].worker_names == ["gpu-0-0", "gpu-0-1"]
    script = dict(slurm.job_scripts(cfg))["gpu-0"]
    assert not any("gres" in d for d in _directives(script))
    cmd = _worker_command(script)
    assert "-m distributed.cli.dask_worker" in cmd and "--nworkers 2" in cmd and "--resources GPU=1" in cmd
    assert slurm.devices(cfg, 0)[0] == 2
    assert slurm.rejoin(cfg)[0] == cfg.cluster.num_env_workers + 2


def test_prologue_and_skipped_directives_are_the_users():
    cfg = _cfg("cluster.job_script_prologue=['module load cuda','conda activate rl']",
               "cluster.job_directives_skip=[--mem]")
    script = dict(slurm.job_scripts(cfg))["env-0"]
    lines = script.splitlines()
    assert "module load cuda" in lines and "conda activate rl" in lines
    assert not any("activate" in ln and "source" in ln for ln in lines)
    assert not any(d.startswith("--mem") for d in _directives(script))


@pytest.mark.parametrize("text,seconds", [("30", 1800), ("30:15", 1815), ("01:00:00", 3600),
                                          ("2-03", 2 * 86400 + 3 * 3600), ("1-00:30", 86400 + 1800),
                                          ("0-01:02:03", 3723)])
def test_slurm_time_limits(text, seconds):
    """sbatch(1) -t forms: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]]."""
    assert slurm.walltime_s(text) == seconds
    assert seconds <= slurm.walltime_s(slurm.format_walltime(seconds)) < seconds + 60  # rounded up to a minute


# ----- refused before submission -----

def test_walltime_shorter_than_the_runs_limit_is_refused():
    with pytest.raises(ConfigError) as e:
        _cfg("cluster.walltime=00:30:00", "runner.max_wall_time_s=3600")
    assert e.value.key == "cluster.walltime" and "cluster.walltime=01:00:00" in e.value.fix
    _cfg("cluster.walltime=01:00:00", "runner.max_wall_time_s=3600")  # exactly enough is fine
    with pytest.raises(ConfigError) as e:
        _cfg("cluster.walltime=1h")
    assert e.value.key == "cluster.walltime"
    with pytest.raises(ConfigError) as e:
        _cfg("cluster.gpus_per_job=4", "cluster.gpu_job_cores=2")
    assert e.value.key == "cluster.gpu_job_cores"


SINFO = "debug*|8|20000|(null)\ngpu|64|512000|gpu:a100:4(S:0-1)\ngpu|64|512000|gpu:a100:8(S:0-1)\n"


@pytest.fixture
def fake_sinfo(monkeypatch):
    """sinfo answering SINFO: partition debug (default, no GPUs) and gpu (nodes of 4 and 8 GPUs)."""
    calls = []

    def run(args, timeout=30.0):
        calls.append(args)
        return SINFO if args[0] == "sinfo" else None
    monkeypatch.setattr(slurm, "_run", run)
    return calls


def test_sinfo_is_read_per_partition(fake_sinfo):
    parts = slurm.sinfo_partitions()
    assert parts["gpu"] == slurm.Partition("gpu", 64, 512000, 8)  # the largest node
    assert parts[None] is parts["debug"] and parts["debug"].gpus == 0


def test_unknown_partition_and_too_many_gpus_are_refused(fake_sinfo):
    from pipelines.clusters import check_placement
    with pytest.raises(PlacementError) as e:
        check_placement(_cfg("cluster.partition=gpus"), 0)
    assert e.value.key == "cluster.partition" and "['debug', 'gpu']" in e.value.fix
    with pytest.raises(PlacementError) as e:
        check_placement(_cfg("cluster.partition=gpu", "cluster.gpu_nodes=true", "cluster.gpus_per_job=16",
                             "cluster.gpu_job_cores=16"), 0)
    assert e.value.key == "cluster.gpus_per_job" and "at most 8 GPUs" in e.value.fix
    with pytest.raises(PlacementError) as e:  # the default partition's nodes have no GPU
        check_placement(_cfg("cluster.gpu_nodes=true"), 0)
    assert e.value.key == "cluster.gpus_per_job"
    with pytest.raises(PlacementError) as e:
        check_placement(_cfg("cluster.env_job_cores=16"), 0)
    assert e.value.key == "cluster.env_job_cores"
    check_placement(_cfg("cluster.partition=gpu", "cluster.gpu_nodes=true", "cluster.gpus_per_job=8",
                         "cluster.gpu_job_cores=8"), 0)


def test_squeue_lists_this_users_jobs_by_id(monkeypatch):
    out = "12|PENDING|Resources\n13|RUNNING|None\n99|RUNNING|None\n"
    monkeypatch.setattr(slurm, "_run", lambda args, timeout=30.0: out)
    assert slurm.squeue(["12", "13", "14"]) == {"12": QueueState("PENDING", "Resources"),
                                                "13": QueueState("RUNNING", "None")}
    monkeypatch.setattr(slurm, "_run", lambda args, timeout=30.0: None)
    assert slurm.squeue(["12"]) is None


# ----- waiting for the jobs, replacing an ended one (fakes: no Slurm) -----

def _fake(jobs: dict[str, str], joined: list[str]):
    cluster = SimpleNamespace(workers={n: SimpleNamespace(job_id=i) for n, i in jobs.items()})
    client = {"workers": {f"tcp://h:{k}": {"name": n} for k, n in enumerate(joined)}}
    return cluster, client


def test_waiting_names_the_pending_jobs_and_squeues_reason():
    cfg = _cfg()
    jobs = slurm.job_specs(cfg)  # env-0, env-1, gpu-0
    cluster, client = _fake({"env-0": "11", "env-1": "12", "gpu-0": "13"}, ["env-0", "env-1"])
    states = {"11": QueueState("RUNNING", "None"), "12": QueueState("RUNNING", "None"),
              "13": QueueState("PENDING", "Resources")}
    said = []
    with pytest.raises(ConnectionError) as e:
        wait_for_jobs(cluster, client, jobs, timeout_s=0.2, queue=lambda ids: states, what="slurm",
                      timeout_key="cluster.start_timeout_s", echo=said.append)
    msg = str(e.value)
    assert msg.startswith("cluster.start_timeout_s=0.2: 2 of 3 workers joined")
    assert "gpu-0 (job 13: PENDING, Resources)" in msg and "env-0" not in msg
    assert said[0] == "dagrl: slurm: jobs 1 pending, 2 running; workers joined 2/3"
    cluster, client = _fake({"env-0": "11", "env-1": "12", "gpu-0": "13"}, ["env-0", "env-1", "gpu-0"])
    assert wait_for_jobs(cluster, client, jobs, timeout_s=0.2, queue=lambda ids: states, what="slurm",
                         timeout_key="k", echo=said.append) >= 0
    cluster, client = _fake({"env-0": "11", "env-1": "12", "gpu-0": "13"}, ["env-0"])
    with pytest.raises(ConnectionError, match=r"job 12 \(env-1\) ended before its worker joined"):
        wait_for_jobs(cluster, client, jobs, timeout_s=30, queue=lambda ids: {"11": states["11"], "13": states["13"]},
                      what="slurm", timeout_key="k", echo=said.append)


def test_job_watch_resubmits_a_job_that_left_the_queue():
    """A job absent from the queue is dropped from the cluster's jobs (kept in its spec) and submitted again under
    the same name; jobs still queued are left alone; an unanswered query changes nothing."""
    from distributed.core import Status
    from distributed.deploy.spec import ProcessInterface

    class Job(ProcessInterface):
        def __init__(self, job_id):
            super().__init__()
            self.job_id = job_id

    class Cluster:
        status = Status.running

        def __init__(self):
            self.worker_spec = {"env-0": {}, "env-1": {}, "gpu-0": {}}
            self.workers = {"env-0": Job("11"), "env-1": Job("12"), "gpu-0": Job("13")}

        async def _correct_state(self):
            for n in set(self.worker_spec) - set(self.workers):
                self.workers[n] = Job("21")

    c, said = Cluster(), []
    queued = {"11": QueueState("RUNNING"), "13": QueueState("RUNNING")}
    watch = JobWatch(c, lambda ids: queued, "slurm", said.append)
    old = c.workers["env-1"]
    assert asyncio.run(watch.check()) == ["env-1"]
    assert c.workers["env-1"].job_id == "21" and old.status == Status.closed
    assert said == ["dagrl: slurm: job(s) 12 (env-1) left the queue; submitted replacement(s) 21 (env-1)"]
    queued["21"] = QueueState("PENDING", "Priority")
    assert asyncio.run(watch.check()) == [] and watch.replaced == [("env-1", "12")]
    assert asyncio.run(JobWatch(c, lambda ids: None, "slurm", said.append).check()) == []


def test_validate_prints_the_job_scripts(capsys, tmp_path):
    from pipelines.validate import main
    assert main(["conf=smoke", "cluster=slurm", "cluster.partition=debug", f"run_root={tmp_path}"]) == 0 or \
        pytest.fail(capsys.readouterr().err)
    out = capsys.readouterr().out
    assert "cluster: slurm, 2 env jobs (CPU) + 1 GPU job of 1 logical GPU;" in out
    assert "--- env-0 (also env-1: the same but the name)" in out and "--- gpu-0" in out
    assert out.count("#!/usr/bin/env bash") == 2 and "#SBATCH -p debug" in out
    assert "--resources CPU=1" in out and "--resources GPU=1" in out
    assert not (tmp_path / "slurm-logs").exists()  # nothing created, nothing submitted


# ----- on the real local Slurm (conftest.py) -----

# conf=smoke cut to 2 steps of 4 chunk steps (two env nodes per shard and step), one eval at step 2
SMOKE = ["conf=smoke", "runner.max_steps=2", "runner.val_check_interval=2", "runner.save_interval=2",
         "runner.progress=false", "cluster.dashboard_address=127.0.0.1:0", "rollout.chunk_steps=4",
         "rollout.chunk_steps_per_node=2", "env.max_episode_steps=6", "policy.hidden_sizes=[32,32]"]


def _run_dir(root: Path) -> Path:
    dirs = [p.parent for p in root.glob("*/*/evals")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def _episodes(run_dir: Path) -> dict[int, list]:
    """step -> its eval episodes without timing fields (benchmarks/same_evals.py's comparison)."""
    out = {}
    for f in (run_dir / "evals").glob("step_*.json"):
        rec = json.loads(f.read_text())
        eps = rec["episodes"]
        eps = [eps[k] for k in sorted(eps)] if isinstance(eps, dict) else eps
        out[int(re.fullmatch(r"step_(\d+)\.json", f.name).group(1))] = [
            {k: v for k, v in e.items() if not any(t in k.lower() for t in ("time", "wall", "second", "duration"))}
            for e in eps]
    return out


def _cli_run(root: Path, *extra: str) -> str:
    """`python -m pipelines.run SMOKE extra run_root=root` in a process of its own; its stdout (exit 0 asserted)."""
    p = subprocess.run([sys.executable, "-m", "pipelines.run", *SMOKE, *extra, f"run_root={root}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    return p.stdout


@pytest.fixture(scope="module")
def local_evals(tmp_path_factory):
    """The eval episodes of SMOKE on the embedded cluster (`cluster=local`, one torch thread in the actor as in a
    one-core GPU job: cluster.actor_threads=1), the reference the Slurm runs must play again."""
    root = tmp_path_factory.mktemp("local")
    _cli_run(root, "cluster.actor_threads=1")
    return _episodes(_run_dir(root))


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_smoke_run_on_slurm_plays_the_local_runs_evaluations(slurm_queue, local_evals, tmp_path):
    """`python -m pipelines.run conf=smoke cluster=slurm` (2 steps) through sbatch jobs: exit 0, the progress and
    joined lines printed, and the same eval episodes as `cluster=local` with the same seeds."""
    out = _cli_run(tmp_path, "cluster=slurm", "cluster.host=127.0.0.1")
    assert re.search(r"dagrl: slurm: jobs \d pending, \d running; workers joined 0/3", out), out
    m = re.search(r"dagrl: slurm: all 3 workers of 3 jobs joined ([\d.]+) s after submission \(([\d.]+) s after "
                  r"the command\)", out)
    assert m, out
    print(f"slurm: workers joined {m.group(1)} s after submission, {m.group(2)} s after the command")
    evals = _episodes(_run_dir(tmp_path))
    assert set(evals) == {2} and evals == local_evals
    assert list((tmp_path / "slurm-logs").glob("dagrl-env-0-*.err"))  # the jobs wrote their logs there


def _scancel_at(address: str, key: str):
    """A worker plugin that cancels its own Slurm job (`scancel $SLURM_JOB_ID`) when task `key` starts executing on
    the worker at `address` (the jobs receive it by value: cloudpickle.register_pickle_by_value of this module)."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class ScancelAt(WorkerPlugin):
        def __init__(self, address, key):
            self.address, self.key, self.worker = address, key, None

        def setup(self, worker):
            self.worker = worker

        def transition(self, key, start, finish, **kwargs):
            if finish == "executing" and str(key) == self.key and self.worker is not None \
                    and self.worker.address == self.address:
                import os
                import subprocess
                subprocess.run(["scancel", os.environ["SLURM_JOB_ID"]], check=False)

    return ScancelAt(address, key)


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_scancel_of_an_env_workers_job_mid_run_is_replaced(slurm_queue, local_evals, tmp_path):
    """Shard 1's worker cancels its own Slurm job (`scancel $SLURM_JOB_ID`) as step 2's first env node starts on it:
    the job watch submits a replacement, the run's recovery retries step 2 on it, the run finishes with every step
    stored once and each MLflow step logged once, and evaluates as the uninterrupted local run did (nothing lost
    or doubled); closing the cluster leaves no job in squeue."""
    import cloudpickle

    from pipelines.clusters import start_cluster
    from pipelines.runner import Runner
    from storage.trajectories import TrajectoryStore

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the jobs cannot import this test module
    cfg, _ = load_config([*SMOKE, "cluster=slurm", "cluster.host=127.0.0.1", f"run_root={tmp_path}",
                          "runner.pause_timeout_s=3"])
    t0 = time.monotonic()
    handle = start_cluster(cfg)
    try:
        said: list[str] = []

        def say(line: str) -> None:  # the run's lines, timed (shown with pytest -s)
            said.append(line)
            print(f"[{time.monotonic() - t0:6.1f} s] {line}", flush=True)
        runner = Runner(cfg, handle, echo=say)
        rid = runner.state.run_id
        victim = runner.placement.shard_workers[1]
        handle.client.register_plugin(_scancel_at(victim, f"env_step_s1-{rid}-1-0"), name="dagrl-test-scancel")
        res = runner.run()
        print(f"[{time.monotonic() - t0:6.1f} s] run finished")
        n = cfg.runner.max_steps
        assert res.steps == n
        assert [name for name, _ in handle.cluster.dagrl_job_watch.replaced] == ["env-1"]
        lost = [m for m in said if "lost" in m]
        assert len(lost) == 1 and "during step 2" in lost[0], said
        store = TrajectoryStore.open(res.store_path)
        assert store.complete_steps().tolist() == list(range(n)) and store.num_steps == n
        assert store.read("rewards").shape[:3:2] == (n, cfg.env.num_envs)
        for key in ("train/weight_version", "train/retries"):
            assert [s for s, _ in runner.tracker.get_metric_history(key)] == list(range(1, n + 1)), key
        assert dict(runner.tracker.get_metric_history("train/retries")) == {1: 0.0, 2: 1.0}
        assert _episodes(Path(res.run_dir)) == local_evals
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        handle.close()


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_scancel_of_the_actors_job_resumes_from_the_last_checkpoint(slurm_queue, tmp_path):
    """The actor's worker cancels its own Slurm job as step 2's update starts on it (a checkpoint every step): the
    job watch submits a replacement, the run restores the actor from step 1's checkpoint on it and finishes, saying
    so in one line that names the ended job, its replacement, the checkpoint and the `runner.resume=` command; the
    checkpoint is kept, every step is stored and logged to MLflow once, and no job is left in squeue."""
    import cloudpickle

    from pipelines.clusters import start_cluster
    from pipelines.runner import Runner
    from storage.trajectories import TrajectoryStore

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the jobs cannot import this test module
    cfg, _ = load_config([*SMOKE, "cluster=slurm", "cluster.host=127.0.0.1", f"run_root={tmp_path}",
                          "runner.save_interval=1", "runner.pause_timeout_s=3"])
    t0 = time.monotonic()
    handle = start_cluster(cfg)
    try:
        said: list[str] = []

        def say(line: str) -> None:  # the run's lines, timed (shown with pytest -s)
            said.append(line)
            print(f"[{time.monotonic() - t0:6.1f} s] {line}", flush=True)
        runner = Runner(cfg, handle, echo=say)
        rid = runner.state.run_id
        victim = runner.placement.actor_workers[0]
        old = handle.cluster.workers["gpu-0"].job_id
        handle.client.register_plugin(_scancel_at(victim, f"actor_update-{rid}-1"), name="dagrl-test-scancel")
        res = runner.run()
        n = cfg.runner.max_steps
        assert res.steps == n
        watch = handle.cluster.dagrl_job_watch
        assert watch.replaced == [("gpu-0", old)]
        new = handle.cluster.workers["gpu-0"].job_id
        ckpt = Path(res.run_dir) / "checkpoints" / "global_step_1"
        lost = [m for m in said if "lost" in m]
        assert len(lost) == 1, said
        line = lost[0]
        assert "lost during step 2; restoring the actor from the last checkpoint and retrying" in line
        assert f"from {ckpt}" in line and f"slurm job {old} (gpu-0) left the queue, replaced by job {new}" in line
        assert f"runner.resume={rid}`" in line and "\n" not in line
        assert ckpt.is_dir() and (Path(res.run_dir) / "checkpoints" / f"global_step_{n}").is_dir()
        store = TrajectoryStore.open(res.store_path)
        assert store.complete_steps().tolist() == list(range(n)) and store.num_steps == n
        assert [s for s, _ in runner.tracker.get_metric_history("train/weight_version")] == list(range(1, n + 1))
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        handle.close()


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_two_rank_actor_across_two_jobs(slurm_queue, tmp_path):
    """algorithm.num_actor_ranks=2 on two GPU jobs (one logical GPU each): the ranks run in different Slurm jobs,
    rendezvous at rank 0's worker address as the scheduler sees it (the machine's address here, the scheduler bound
    to every interface: cluster.host null), and train 2 steps."""
    from pipelines.clusters import host_of, start_cluster
    from pipelines.runner import Runner
    cfg, _ = load_config([*SMOKE, "cluster=slurm", "cluster.gpu_jobs=2", "algorithm.num_actor_ranks=2",
                          "cluster.component_placement.actor=0-1", f"run_root={tmp_path}"])
    handle = start_cluster(cfg)
    try:
        runner = Runner(cfg, handle, echo=lambda line: None)
        ranks = runner.placement.actor_workers
        jobs = handle.client.run(lambda: __import__("os").environ.get("SLURM_JOB_ID"), workers=ranks)  # by value
        assert len(ranks) == 2 and len({jobs[w] for w in ranks}) == 2 and None not in jobs.values()
        addr = runner.sched.group["master_addr"]
        info = handle.client.scheduler_info(n_workers=-1)["workers"]
        assert addr == host_of(ranks[0]) and info[ranks[0]]["name"] == "gpu-0"
        if not host_of(handle.client.scheduler.address).startswith("127."):  # not localhost when the host has
            assert not addr.startswith("127.")  # another address (the scheduler bound to every interface)
        res = runner.run()
        assert res.steps == cfg.runner.max_steps
        assert [v for _, v in runner.tracker.get_metric_history("train/actor_ranks")] == [2.0] * res.steps
        print(f"2 ranks in jobs {sorted(jobs.values())}, rendezvous at {addr}")
    finally:
        handle.close()


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_real_slurm_refusals_and_a_timeout_leave_no_job(slurm_queue, tmp_path):
    """On the real Slurm: an unknown partition is refused before submission with sinfo's list; jobs that cannot
    start in time (`--begin=now+1hour`: PENDING, reason BeginTime) end the start with one line naming each job and
    squeue's reason, and are cancelled (slurm_queue: squeue empty after)."""
    from pipelines.clusters import start_cluster
    base = ["cluster=slurm", "cluster.host=127.0.0.1", "cluster.dashboard_address=127.0.0.1:0", f"run_root={tmp_path}"]
    with pytest.raises(PlacementError) as e:
        start_cluster(load_config([*base, "cluster.partition=debgu"])[0])
    assert e.value.key == "cluster.partition" and "['debug']" in e.value.fix and not slurm_queue.jobs()
    cfg, _ = load_config([*base, "cluster.start_timeout_s=8", "cluster.job_extra_directives=['--begin=now+1hour']"])
    with pytest.raises(ConnectionError) as e:
        start_cluster(cfg)
    msg = str(e.value)
    assert msg.startswith("cluster.start_timeout_s=8: 0 of 3 workers joined within 8 s; still waiting: ")
    for name in ("env-0", "env-1", "gpu-0"):
        assert re.search(rf"{name} \(job \d+: PENDING, BeginTime\)", msg), msg


def test_importing_dask_jobqueue_through_dagrl_keeps_the_drivers_sigint_handler():
    """dask-jobqueue 0.9 replaces the SIGINT handler with `sys.exit()` when imported (its runner module); a driver
    that had installed its Ctrl-C handler (checkpoint the step, one line) would lose it when the Slurm kind starts.
    In a fresh process: a plain import replaces a handler set before it (the hazard is real), the import through
    `pipelines.clusters.jobqueue.import_jobqueue` keeps it."""
    import subprocess
    import sys
    code = ("import signal\n"
            "def mine(*_): pass\n"
            "signal.signal(signal.SIGINT, mine)\n"
            "{imp}\n"
            "print(signal.getsignal(signal.SIGINT) is mine)\n")
    plain = subprocess.run([sys.executable, "-c", code.format(imp="import dask_jobqueue.slurm")],
                           capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == "False"
    ours = subprocess.run([sys.executable, "-c", code.format(
        imp="from pipelines.clusters.jobqueue import import_jobqueue\nm = import_jobqueue()\nassert m.SLURMJob")],
        capture_output=True, text=True, check=True)
    assert ours.stdout.strip() == "True"
