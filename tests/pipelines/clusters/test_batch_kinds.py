"""`cluster.kind` pbs, lsf, sge (pipelines/clusters/{pbs,lsf,sge}.py over batch.py and jobqueue.py), unit tier.

No PBS, LSF or Grid Engine runs here: the job scripts are dask-jobqueue's `job_script()` of the jobs the placement
asks for (each directive carrying the keys' values), the time limits are the schedulers' documented forms, the
refusals are those that need no scheduler, and the queue listings parsed are SAMPLE OUTPUTS WRITTEN HERE FROM EACH
SCHEDULER'S DOCUMENTED FORMAT (OpenPBS `qstat -f -F json`, LSF 10.1 `bjobs -o ... delimiter=`, Grid Engine
`qstat -xml`), not recorded from a real scheduler. The waiting, the job watch and the recovery line are the ones
the real local Slurm runs (test_slurm.py); here they are fed by these parses.
"""
from __future__ import annotations

import asyncio
import math
import sys
from types import SimpleNamespace

import pytest

from pipelines.clusters import batch, lsf, pbs, sge
from pipelines.clusters.jobqueue import JobWatch, QueueState, wait_for_jobs
from pipelines.config import load_config
from tasks.config import ConfigError

KINDS = {"pbs": pbs, "lsf": lsf, "sge": sge}
PREFIX = {"pbs": "#PBS ", "lsf": "#BSUB ", "sge": "#$ "}
ACCOUNT = {"pbs": "account", "lsf": "project", "sge": "project"}


def _cfg(kind: str, *overrides: str, tmp_path=None):
    cfg, _ = load_config([f"cluster={kind}", *overrides, *([f"run_root={tmp_path}"] if tmp_path else [])])
    return cfg


def _directives(kind: str, script: str) -> list[str]:
    p = PREFIX[kind]
    return [ln[len(p):] for ln in script.splitlines() if ln.startswith(p)]


def _asks_gpus(directives: list[str]) -> bool:
    """Whether a directive other than the name, queue and output files mentions GPUs."""
    return any("gpu" in x.lower() for x in directives if x.split()[0] not in ("-N", "-J", "-q", "-o", "-e"))


# ----- the job scripts -----

@pytest.mark.parametrize("kind", list(KINDS))
def test_job_scripts_carry_the_keys_in_each_schedulers_directives(kind, tmp_path):
    """2 env jobs of 3 cores and 2 GPU jobs of 2 GPUs on GPU nodes (6 cores), 2 GiB per worker: every job carries
    the queue, the account/project, the walltime, its cores and memory (per worker x workers) and, for a GPU job, its
    GPUs, spelt as the scheduler reads them; the workers are those of the placement (CPU=1 / GPU=1, dask cuda
    worker on GPU nodes)."""
    wall = {"pbs": "02:30:00", "lsf": "02:30", "sge": "02:30:00"}[kind]
    queue = {"pbs": "workq", "lsf": "gpu", "sge": "gpu.q"}[kind]
    extra = {"pbs": "-l place=scatter", "lsf": "-x", "sge": "-R y"}[kind]
    keys = ["cluster.num_env_workers=2", "cluster.gpu_jobs=2", "cluster.gpus_per_job=2", "cluster.gpu_nodes=true",
            "cluster.gpu_job_cores=6", "cluster.env_job_cores=3", f"cluster.queue={queue}",
            f"cluster.{ACCOUNT[kind]}=lab", f"cluster.walltime={wall}", "cluster.memory_limit=2GiB",
            f"cluster.job_extra_directives=['{extra}']"]
    keys += {"lsf": ["cluster.lsf_units=mb"], "sge": ["cluster.gpu_resource=gpu"], "pbs": []}[kind]
    cfg = _cfg(kind, *keys, tmp_path=tmp_path)
    scripts = dict(KINDS[kind].job_scripts(cfg)) if hasattr(KINDS[kind], "job_scripts") else \
        dict(batch.job_scripts(cfg, KINDS[kind].SYSTEM))
    assert list(scripts) == ["env-0", "env-1", "gpu-0", "gpu-1"]
    logs = tmp_path / f"{kind}-logs"
    assert batch.log_directory(cfg) == str(logs)
    for name, script in scripts.items():
        d = _directives(kind, script)
        gpu = name.startswith("gpu")
        cores, mib, gpus = (6, 2 * 2 * 1024, 2) if gpu else (3, 2 * 1024, 0)  # memory: per worker x workers
        if kind == "pbs":
            # PBS sizes: dask-jobqueue writes MB (= MiB) below 10 GiB; ngpus is PBS Pro's GPU resource
            want = {"-N dagrl-" + name, "-q workq", "-A lab", "-l walltime=02:30:00", f"-o {logs}/", f"-e {logs}/",
                    f"-l select=1:ncpus={cores}:mem={mib}MB" + (f":ngpus={gpus}" if gpu else "")}
        elif kind == "lsf":
            # -M in lsf_units (mb: 10^6 bytes, dask-jobqueue's lsf_format_bytes_ceil), -gpu "num=N" (LSF 10.1)
            want = {"-J dagrl-" + name, "-q gpu", '-P "lab"', "-W 02:30", f"-n {cores}", '-R "span[hosts=1]"',
                    f"-M {math.ceil(mib * 2**20 / 1000**2)}", f"-o {logs}/{name}-%J.out", f"-e {logs}/{name}-%J.err"}
            want |= {'-gpu "num=2"'} if gpu else set()
        else:
            # h_vmem is per slot: the job's memory over its cores, rounded up to MiB; the GPU complex per job
            want = {"-N dagrl-" + name, "-q gpu.q", "-P lab", "-l h_rt=02:30:00", f"-pe smp {cores}",
                    f"-l h_vmem={math.ceil(mib / cores)}M" + (",gpu=2" if gpu else ""), f"-o {logs}/"}
        assert want <= set(d), (want - set(d), d)
        assert d[-1] == extra  # the user's directives last
        assert _asks_gpus(d) == gpu, d
        cmd = script.rstrip().splitlines()[-1]
        assert cmd.startswith(sys.executable) and f"--name {name}" in cmd
        assert f"--resources {'GPU' if gpu else 'CPU'}=1" in cmd and ("-m dask cuda worker" in cmd) == gpu
        assert f"export OMP_NUM_THREADS={6 // 2 if gpu else 1}" in script
    assert not logs.exists()  # nothing created, nothing submitted


@pytest.mark.parametrize("kind", list(KINDS))
def test_logical_gpus_ask_the_scheduler_for_none(kind):
    """Without GPU nodes a GPU job asks for no GPU and starts plain workers carrying the logical GPU resource; one
    core jobs need no parallel environment (SGE) and no span (LSF)."""
    cfg = _cfg(kind, "cluster.gpu_jobs=1", "cluster.gpus_per_job=2", "cluster.gpu_job_cores=2")
    script = dict(batch.job_scripts(cfg, KINDS[kind].SYSTEM))["gpu-0"]
    d = _directives(kind, script)
    assert not _asks_gpus(d), d
    assert "--nworkers 2" in script and "--resources GPU=1" in script and "dask cuda worker" not in script
    env = _directives(kind, dict(batch.job_scripts(cfg, KINDS[kind].SYSTEM))["env-0"])
    assert not any(x.startswith("-pe") or "span" in x for x in env), env
    assert KINDS[kind].devices(cfg, 0)[0] == 2 and KINDS[kind].rejoin(cfg)[0] == cfg.cluster.num_env_workers + 2


@pytest.mark.parametrize("kind", ["slurm", *KINDS])
def test_each_description_matches_dask_jobqueues_class(kind):
    """A kind's `BatchSystem` names the commands and the directive prefix its dask-jobqueue Job class uses (the
    lines and the docs say them; dask-jobqueue runs them), and each kind is its own module's description."""
    import importlib
    module = importlib.import_module(f"pipelines.clusters.{kind}")
    system = module.SYSTEM
    job = system.job_class()
    assert system.kind == kind and job.config_name == kind
    assert (system.submit, system.cancel) == (job.submit_command, job.cancel_command)
    script = dict(batch.job_scripts(_cfg(kind, "cluster.num_env_workers=1"), system))["env-0"]
    assert f"{system.prefix} " in script and system.cluster_class().job_cls is job


# ----- time limits -----

@pytest.mark.parametrize("text,seconds", [("45", 45), ("30:15", 1815), ("01:00:00", 3600), ("36:00:00", 129600)])
def test_pbs_and_sge_time_limits(text, seconds):
    """qsub -l walltime / h_rt: [[HH:]MM:]SS, a bare number being seconds."""
    assert batch.hms_walltime_s(text) == seconds
    assert seconds <= batch.hms_walltime_s(batch.format_hms(seconds)) < seconds + 60  # rounded up to a minute


@pytest.mark.parametrize("text,seconds", [("90", 5400), ("1:30", 5400), ("00:05", 300), ("48:00", 172800)])
def test_lsf_run_limits(text, seconds):
    """bsub -W: [HH:]MM, a bare number being minutes."""
    assert lsf.walltime_s(text) == seconds
    assert seconds <= lsf.walltime_s(lsf.format_walltime(seconds)) < seconds + 60


# ----- refused before submission -----

@pytest.mark.parametrize("kind,short,enough", [("pbs", "00:30:00", "01:00:00"), ("lsf", "00:30", "01:00"),
                                               ("sge", "1800", "3600")])
def test_walltime_shorter_than_the_runs_limit_is_refused(kind, short, enough):
    with pytest.raises(ConfigError) as e:
        _cfg(kind, f"cluster.walltime={short}", "runner.max_wall_time_s=3600")
    want = "01:00" if kind == "lsf" else "01:00:00"  # the scheduler's own form of 3600 s
    assert e.value.key == "cluster.walltime" and f"cluster.walltime={want}" in e.value.fix
    _cfg(kind, f"cluster.walltime={enough}", "runner.max_wall_time_s=3600")  # exactly enough is fine
    with pytest.raises(ConfigError) as e:
        _cfg(kind, "cluster.walltime=1h")
    assert e.value.key == "cluster.walltime"


def test_refusals_that_need_no_scheduler():
    """A key of another scheduler is unknown (pbs has no partition); Grid Engine GPUs need the site's GPU resource
    and jobs of several cores its parallel environment; every kind: a core per GPU worker, no TLS yet."""
    with pytest.raises(ConfigError) as e:
        _cfg("pbs", "cluster.partition=gpu")
    assert e.value.key == "cluster.partition"
    with pytest.raises(ConfigError) as e:
        _cfg("sge", "cluster.gpu_nodes=true")
    assert e.value.key == "cluster.gpu_nodes" and "cluster.gpu_resource" in e.value.fix
    _cfg("sge", "cluster.gpu_nodes=true", "cluster.gpu_resource=gpu")
    with pytest.raises(ConfigError) as e:
        _cfg("sge", "cluster.parallel_environment=null", "cluster.env_job_cores=2")
    assert e.value.key == "cluster.parallel_environment"
    for kind in KINDS:
        with pytest.raises(ConfigError) as e:
            _cfg(kind, "cluster.gpus_per_job=4", "cluster.gpu_job_cores=2")
        assert e.value.key == "cluster.gpu_job_cores"


# ----- the queue listings (sample outputs written from the documented formats) -----

# OpenPBS `qstat -f -F json`: {"Jobs": {"<id>.<server>": {"job_state": ..., "comment": ...}}}
QSTAT_JSON = """{"timestamp": 1700000000, "pbs_version": "22.05.11", "pbs_server": "pbs01", "Jobs": {
  "101.pbs01": {"Job_Name": "dagrl-env-0", "job_state": "R",
                "comment": "Job run at Mon Jan 01 at 10:00 on (n1:ncpus=1)"},
  "102.pbs01": {"Job_Name": "dagrl-gpu-0", "job_state": "Q",
                "comment": "Not Running: Insufficient amount of resource: ngpus (R: 4 A: 0 T: 8)"},
  "103.pbs01": {"Job_Name": "dagrl-env-1", "job_state": "E", "comment": "Job run at Mon Jan 01 at 10:00 on (n2)"},
  "104.pbs01": {"Job_Name": "dagrl-env-2", "job_state": "H"},
  "999.pbs01": {"Job_Name": "someone-else", "job_state": "R"}}}"""

# LSF 10.1 `bjobs -noheader -o "jobid stat pend_reason delimiter='|'"` ("-" for an empty field)
BJOBS = """201|RUN|-
202|PEND|New job is waiting for scheduling;
203|DONE|-
204|PSUSP|The job was suspended by user;
999|RUN|-
"""

# Grid Engine `qstat -xml`: running jobs under queue_info, pending ones under job_info
QSTAT_XML = """<?xml version='1.0'?>
<job_info  xmlns:xsd="http://arc.liv.ac.uk/repos/darcs/sge/source/dist/util/resources/schemas/qstat/qstat.xsd">
  <queue_info>
    <job_list state="running">
      <JB_job_number>301</JB_job_number><JAT_prio>0.55500</JAT_prio><JB_name>dagrl-env-0</JB_name>
      <JB_owner>alice</JB_owner><state>r</state><JAT_start_time>2024-01-01T10:00:00</JAT_start_time>
      <queue_name>all.q@node1</queue_name><slots>1</slots>
    </job_list>
    <job_list state="running">
      <JB_job_number>304</JB_job_number><JB_name>dagrl-env-1</JB_name><JB_owner>alice</JB_owner>
      <state>dr</state><queue_name>all.q@node2</queue_name><slots>1</slots>
    </job_list>
  </queue_info>
  <job_info>
    <job_list state="pending">
      <JB_job_number>302</JB_job_number><JB_name>dagrl-gpu-0</JB_name><JB_owner>alice</JB_owner>
      <state>qw</state><JB_submission_time>2024-01-01T10:00:00</JB_submission_time><queue_name></queue_name>
      <slots>1</slots>
    </job_list>
    <job_list state="pending">
      <JB_job_number>303</JB_job_number><JB_name>dagrl-gpu-1</JB_name><JB_owner>alice</JB_owner>
      <state>Eqw</state><queue_name></queue_name><slots>1</slots>
    </job_list>
    <job_list state="pending">
      <JB_job_number>305</JB_job_number><JB_name>dagrl-env-2</JB_name><JB_owner>alice</JB_owner>
      <state>hqw</state><queue_name></queue_name><slots>1</slots>
    </job_list>
  </job_info>
</job_info>
"""


def _answer(monkeypatch, module, out):
    calls = []

    def run(args, timeout=30.0, empty_if=None):
        calls.append(args)
        return out
    monkeypatch.setattr(module, "_run", run)
    return calls


def test_pbs_qstat_json(monkeypatch):
    """Q and H are pending (with PBS's comment as the reason), R running, E (exiting) ended; other jobs ignored."""
    calls = _answer(monkeypatch, pbs, QSTAT_JSON)
    got = pbs.qstat(["101", "102", "103", "104"])
    assert calls == [["qstat", "-f", "-F", "json"]]
    assert got == {"101": QueueState("RUNNING", "Job run at Mon Jan 01 at 10:00 on (n1:ncpus=1)"),
                   "102": QueueState("PENDING", "Not Running: Insufficient amount of resource: ngpus (R: 4 A: 0 T: 8)"),
                   "104": QueueState("PENDING", "")}
    _answer(monkeypatch, pbs, '{"timestamp": 1, "pbs_server": "pbs01"}')  # no job at all: no "Jobs"
    assert pbs.qstat(["101"]) == {}
    for out in (None, "qstat: illegal -F value"):  # no answer; Torque's qstat has no JSON
        _answer(monkeypatch, pbs, out)
        assert pbs.qstat(["101"]) is None


def test_lsf_bjobs(monkeypatch):
    """PEND is pending with bjobs' reason, RUN running ("-": no reason), DONE ended, PSUSP kept as LSF says."""
    calls = _answer(monkeypatch, lsf, BJOBS)
    assert lsf.bjobs(["201", "202", "203", "204"]) == {
        "201": QueueState("RUNNING", ""), "202": QueueState("PENDING", "New job is waiting for scheduling;"),
        "204": QueueState("PSUSP", "The job was suspended by user;")}
    assert calls[0][:3] == ["bjobs", "-noheader", "-o"]
    _answer(monkeypatch, lsf, None)
    assert lsf.bjobs(["201"]) is None


def test_an_empty_lsf_queue_is_an_answer():
    """bjobs says "No unfinished job found" (on stderr, with a failing exit status on some versions): an empty
    queue, not a queue that does not answer."""
    cmd = ["sh", "-c", "echo 'No unfinished job found' >&2; exit 255"]
    assert batch.run_command(cmd, empty_if="No unfinished job") == ""
    assert batch.run_command(cmd) is None


def test_sge_qstat_xml(monkeypatch):
    """r running, qw and hqw pending (no reason: qstat -xml has none), Eqw in error with how to see and clear it,
    dr (being deleted) ended."""
    _answer(monkeypatch, sge, QSTAT_XML)
    got = sge.qstat_xml(["301", "302", "303", "304", "305"])
    assert set(got) == {"301", "302", "303", "305"}
    assert got["301"] == QueueState("RUNNING") and got["302"] == got["305"] == QueueState("PENDING")
    assert got["303"].state == "ERROR" and "qstat -j 303" in got["303"].reason and "qmod -cj 303" in got["303"].reason
    for out in (None, "<job_info><unclosed>"):
        _answer(monkeypatch, sge, out)
        assert sge.qstat_xml(["301"]) is None


# ----- the waiting and the watch, fed by these parses -----

def test_waiting_says_each_schedulers_reason_or_that_it_has_none(monkeypatch):
    """The start's timeout names each job still waiting with its state and reason (PBS's comment); Grid Engine's
    listing has none, which the line says."""
    cluster = SimpleNamespace(workers={"env-0": SimpleNamespace(job_id="101"), "gpu-0": SimpleNamespace(job_id="102")})
    client = {"workers": {"tcp://h:1": {"name": "env-0"}}}
    jobs = batch.job_specs(_cfg("pbs", "cluster.num_env_workers=1"), pbs.SYSTEM)
    _answer(monkeypatch, pbs, QSTAT_JSON)
    with pytest.raises(ConnectionError) as e:
        wait_for_jobs(cluster, client, jobs, timeout_s=0.1, queue=pbs.qstat, what="pbs",
                      timeout_key="cluster.start_timeout_s", echo=lambda line: None)
    assert "gpu-0 (job 102: PENDING, Not Running: Insufficient amount of resource: ngpus" in str(e.value)
    cluster.workers = {"env-0": SimpleNamespace(job_id="301"), "gpu-0": SimpleNamespace(job_id="302")}
    _answer(monkeypatch, sge, QSTAT_XML)
    said = []
    with pytest.raises(ConnectionError) as e:
        wait_for_jobs(cluster, client, jobs, timeout_s=0.1, queue=sge.qstat_xml, what="sge",
                      timeout_key="cluster.start_timeout_s", echo=said.append, no_reason=sge.SYSTEM.no_reason)
    assert "gpu-0 (job 302: PENDING) (Grid Engine's qstat -xml gives no reason" in str(e.value)
    assert said[0] == "dagrl: sge: jobs 1 pending, 1 running; workers joined 1/2"


@pytest.mark.parametrize("kind,out,ended", [("pbs", QSTAT_JSON, "103"), ("lsf", BJOBS, "203"),
                                            ("sge", QSTAT_XML, "304")])
def test_job_watch_resubmits_the_job_each_listing_shows_ended(monkeypatch, kind, out, ended):
    """The job watch over each scheduler's parse: the job the listing shows ended (PBS E, LSF DONE, SGE dr) is
    submitted again under its name; the others are left alone; `describe` names it and its replacement."""
    from distributed.core import Status
    from distributed.deploy.spec import ProcessInterface

    class Job(ProcessInterface):
        def __init__(self, job_id):
            super().__init__()
            self.job_id = job_id

    running = {"pbs": "101", "lsf": "201", "sge": "301"}[kind]

    class Cluster:
        status = Status.running

        def __init__(self):
            self.worker_spec = {"env-0": {}, "gpu-0": {}}
            self.workers = {"env-0": Job(running), "gpu-0": Job(ended)}

        async def _correct_state(self):
            for n in set(self.worker_spec) - set(self.workers):
                self.workers[n] = Job("777")

    module = KINDS[kind]
    _answer(monkeypatch, module, out)
    c, said = Cluster(), []
    watch = JobWatch(c, module.SYSTEM.queue, kind, said.append)
    assert asyncio.run(watch.check()) == ["gpu-0"]
    assert c.workers["gpu-0"].job_id == "777" and c.workers["env-0"].job_id == running
    assert said == [f"dagrl: {kind}: job(s) {ended} (gpu-0) left the queue; submitted replacement(s) 777 (gpu-0)"]
    assert watch.describe(["gpu-0-1"]) == f"{kind} job {ended} (gpu-0) left the queue, replaced by job 777"
    assert watch.describe(["env-0"]) == ""


# ----- pipelines.validate -----

@pytest.mark.parametrize("kind", list(KINDS))
def test_validate_prints_the_job_scripts(kind, capsys, tmp_path):
    from pipelines.validate import main
    assert main(["conf=smoke", f"cluster={kind}", "cluster.queue=q1", f"run_root={tmp_path}"]) == 0 or \
        pytest.fail(capsys.readouterr().err)
    out = capsys.readouterr().out
    submit = {"pbs": "qsub", "lsf": "bsub", "sge": "qsub"}[kind]
    assert (f"cluster: {kind}, 2 env jobs (CPU) + 1 GPU job of 1 logical GPU; queue q1, walltime "
            f"{_cfg(kind).cluster.walltime}; job scripts (pipelines.run submits them with {submit}):") in out
    assert "--- env-0 (also env-1: the same but the name)" in out and "--- gpu-0" in out
    assert out.count("#!/usr/bin/env bash") == 2 and f"{PREFIX[kind]}-q q1" in out
    assert not (tmp_path / f"{kind}-logs").exists()


def test_the_recovery_line_names_the_lost_job_the_checkpoint_and_the_resume(tmp_path):
    """The run's recovery line after a loss (pipelines.runner.recovery) ends with what the job watch says of the
    lost workers' jobs (`ClusterHandle.lost_jobs`), and after a lost actor the checkpoint it is restored from and the
    `runner.resume=` command that continues from it should the run stop; nothing is added without jobs or an actor
    loss, and without a checkpoint no resume is offered."""
    from pipelines.clusters.handle import ClusterHandle
    from pipelines.runner.recovery import Recovery
    jobwatch = SimpleNamespace(describe=lambda names: "slurm job 12 (gpu-0) left the queue, replaced by job 21"
                               if "gpu-0" in names else "")
    handle = ClusterHandle(None, SimpleNamespace(dagrl_job_watch=jobwatch), "")
    names = {"tcp://a:1": "gpu-0", "tcp://a:2": "env-1"}
    watch = SimpleNamespace(worker_names=lambda addrs: sorted(names[a] for a in addrs))
    rec = Recovery(None, SimpleNamespace(run_id="20260101-000000-abcd"), watch=watch, ctx=None, checkpoint=None,
                   rollback=None, jobs=handle.lost_jobs)
    ckpt = tmp_path / "checkpoints" / "global_step_1"
    line = rec._details({"tcp://a:1"}, True, ckpt)
    assert line == (f" (from {ckpt}; slurm job 12 (gpu-0) left the queue, replaced by job 21; should this run stop, "
                    f"resume with `python -m pipelines.run conf=<this config> runner.resume=20260101-000000-abcd`)")
    assert rec._details({"tcp://a:2"}, False, None) == ""
    assert "resume" not in rec._details({"tcp://a:1"}, True, None)
    assert ClusterHandle(None, None, "").lost_jobs(["gpu-0"]) == ""  # an existing scheduler: no jobs
