"""`cluster.kind=slurm` (conf/cluster/slurm.yaml): the workers are Slurm batch jobs (dask-jobqueue's SLURMJob) that
this driver submits with `sbatch`, its Dask scheduler running in the driver; every job is cancelled (`scancel`) when
the run ends, is interrupted or fails.

The placement decides the jobs (pipelines.clusters.jobqueue): `num_env_workers` CPU jobs `env-i` (worker resource
`CPU=1`, `env_job_cores` cores) and `gpu_jobs` GPU jobs `gpu-j` of `gpus_per_job` workers each (resource `GPU=1` per
GPU, `gpu_job_cores` cores). With `gpu_nodes: true` a GPU job asks for its GPUs (`--gres=gpu:N`) and starts them with
`dask cuda worker` (dask-cuda: one worker per GPU); with `gpu_nodes: false` (a CPU-only cluster, as the embedded
cluster's logical GPU) its workers are plain ones carrying the logical `GPU` resource. Every job gets `partition`,
`account`, `walltime`, `memory_limit` per worker (`--mem`), `job_extra_directives`, and the shell lines of
`job_script_prologue` (default: activate this driver's virtual environment) before the worker starts; its output
goes to `log_directory` (default `<run_root>/slurm-logs`, `%x-%j.out`).

`pipelines.validate cluster=slurm ...` prints the job scripts (`job_script()`), submitting nothing. Refused before
anything is submitted, with the key and the fix: a walltime shorter than `runner.max_wall_time_s`, and, where
`sinfo` answers, a partition Slurm does not know and jobs asking for more GPUs, cores or memory than a node of the
partition has. `start` waits for every worker with a progress line (jobs pending / running, workers joined) for at
most `start_timeout_s`, naming the jobs still pending and squeue's reason when it gives up, and prints the time from
the command to all workers joined. A job that leaves the queue mid-run (`scancel`, preemption, walltime) is submitted
again under the same worker names (jobqueue.JobWatch); the run's recovery retries the step on it (an actor's job:
from the last checkpoint).

The kind's interface (`pipelines.clusters.ClusterKind`): `start`, `check_machine`, `devices`, `env_served`,
`rejoin`, `describe`, `attach`, `TLS_ROLES`.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from pipelines.clusters.checks import check_cluster
from pipelines.clusters.errors import PlacementError
from pipelines.clusters.handle import ClusterHandle, scheduler_config
from pipelines.clusters.jobqueue import (JobSpec, JobWatch, QueueState, cluster_class, job_class, job_script,
                                         wait_for_jobs)
from pipelines.clusters.tls import TLS_FILES, tls_enabled
from tasks.config import Config, ConfigError, register_family
from tasks.config.schema import ClusterConfig


def check_slurm(cfg: Config) -> None:
    """`cluster.kind=slurm`'s rules (ConfigError naming the key and the fix): positive job counts, cores and start
    timeout, at least one core per GPU worker, a `memory_limit` dask can read, a Slurm walltime no shorter than
    `runner.max_wall_time_s`, and no TLS (not supported by this kind yet)."""
    c = cfg.cluster
    for key in ("num_env_workers", "gpu_jobs", "gpus_per_job", "env_job_cores", "gpu_job_cores"):
        if getattr(c, key) < 1:
            raise ConfigError(f"cluster.{key}", getattr(c, key), "must be >= 1")
    if c.gpu_job_cores < c.gpus_per_job:
        raise ConfigError("cluster.gpu_job_cores", c.gpu_job_cores,
                          f"a GPU job runs one worker per GPU (cluster.gpus_per_job={c.gpus_per_job}), each needs a "
                          f"core: set cluster.gpu_job_cores >= {c.gpus_per_job}")
    if not c.start_timeout_s > 0:
        raise ConfigError("cluster.start_timeout_s", c.start_timeout_s,
                          "must be > 0 (seconds for the jobs' workers to join, queue wait included)")
    from dask.utils import parse_bytes
    try:
        parse_bytes(c.memory_limit)
    except (ValueError, TypeError):
        raise ConfigError("cluster.memory_limit", c.memory_limit, "give a size such as 3GiB or 4000MB (each "
                                                                  "worker's memory; a job asks for it per worker)")
    try:
        wall = walltime_s(c.walltime)
    except ValueError as exc:
        raise ConfigError("cluster.walltime", c.walltime, str(exc)) from None
    limit = cfg.runner.max_wall_time_s
    if limit is not None and wall < limit:
        raise ConfigError("cluster.walltime", c.walltime,
                          f"is {wall:g} s, shorter than runner.max_wall_time_s={limit:g}: Slurm would end the jobs "
                          f"mid-run; set cluster.walltime={format_walltime(limit)} or more, or lower "
                          f"runner.max_wall_time_s")
    if tls_enabled(c.security):
        raise ConfigError("cluster.security", "TLS", "cluster.kind=slurm does not set up TLS yet: drop "
                                                     "cluster.security, or start the jobs yourself and use "
                                                     "cluster.kind=address with TLS")


@register_family("cluster", "slurm", checks=(check_cluster, check_slurm))
@dataclass(frozen=True)
class SlurmClusterConfig(ClusterConfig):
    """`cluster` with `kind: slurm` (conf/cluster/slurm.yaml): the batch jobs this driver submits."""

    kind: str = "slurm"
    num_env_workers: int = 2  # CPU jobs env-i, one env worker each (resource CPU=1)
    gpu_jobs: int = 1  # GPU jobs gpu-j
    gpus_per_job: int = 1  # GPUs of a GPU job: one worker each (resource GPU=1); --gres=gpu:N with gpu_nodes
    gpu_nodes: bool = False  # the GPU jobs' nodes have GPUs: --gres=gpu:N, `dask cuda worker`; false: logical GPUs
    env_job_cores: int = 1  # --cpus-per-task of an env job
    gpu_job_cores: int = 1  # --cpus-per-task of a GPU job (the actor's torch threads: these / gpus_per_job)
    partition: Optional[str] = None  # -p; null: the cluster's default partition
    account: Optional[str] = None  # -A; null: the user's default account
    walltime: str = "01:00:00"  # -t (Slurm's forms: MM, HH:MM:SS, D-HH:MM:SS, ...); >= runner.max_wall_time_s
    job_extra_directives: list[str] = field(default_factory=list)  # more #SBATCH lines, e.g. ["--qos=high"]
    job_directives_skip: list[str] = field(default_factory=list)  # generated directives to drop, e.g. ["--mem"]
    job_script_prologue: Optional[list[str]] = None  # shell lines before the worker; null: activate this venv
    interface: Optional[str] = None  # network interface of the scheduler and the workers (e.g. ib0); null: default
    host: Optional[str] = None  # the scheduler's address to bind (e.g. 127.0.0.1 on a one-node Slurm); null: any
    dashboard_address: str = ":8787"  # the scheduler's dashboard
    log_directory: Optional[str] = None  # the jobs' output (%x-%j.out/.err); null: <run_root>/slurm-logs
    start_timeout_s: float = 600.0  # every job's workers joined within this (queue wait included), else one line
    WORKERS_HERE: ClassVar[bool] = False  # the workers run on the cluster's nodes

    @property
    def env_workers(self) -> int:
        """The env workers this kind starts: `num_env_workers` (the offline memory estimates count on them)."""
        return self.num_env_workers

    @property
    def gpu_workers(self) -> int:
        """GPU workers of the cluster: `gpu_jobs` x `gpus_per_job`."""
        return self.gpu_jobs * self.gpus_per_job


TLS_ROLES = TLS_FILES  # refused by check_slurm for now; the driver would start every role


# ----- Slurm's time formats and commands -----

def walltime_s(text: str) -> float:
    """Seconds of a Slurm time limit: "MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS" (sbatch(1) -t).
    Raises ValueError naming the forms."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(text).strip())
    if not m:
        raise ValueError("not a Slurm time limit: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    d, a, b, c = m.groups()
    if d is None:  # MM | MM:SS | HH:MM:SS
        parts = [int(a)] + [int(x) for x in (b, c) if x is not None]
        if len(parts) == 3:
            return float(parts[0] * 3600 + parts[1] * 60 + parts[2])
        return float(parts[0] * 60 + (parts[1] if len(parts) == 2 else 0))
    return float(int(d) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0))


def format_walltime(seconds: float) -> str:
    """Seconds (rounded up to a whole minute) as Slurm's D-HH:MM:SS (HH:MM:SS under a day)."""
    s = int(-(-float(seconds) // 60) * 60)
    d, rest = divmod(s, 86400)
    out = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:00"
    return f"{d}-{out}" if d else out


def _run(args: list[str], timeout: float = 30.0) -> str | None:
    """stdout of a Slurm command, or None when it is not installed, fails or does not answer in time."""
    if shutil.which(args[0]) is None:
        return None
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def squeue(job_ids: list[str]) -> dict[str, QueueState] | None:
    """{job id: QueueState(state, reason)} of `job_ids` still in Slurm's queue (an ended job is absent), or None
    when squeue does not answer. (This user's jobs are listed and filtered: `squeue -j` fails on an id Slurm has
    forgotten already.)"""
    out = _run(["squeue", "-h", "--me", "-o", "%i|%T|%r"])
    if out is None:
        return None
    want = {str(i) for i in job_ids}
    states = {}
    for line in out.splitlines():
        i, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if i in want:
            states[i] = QueueState(state, reason)
    return states


@dataclass(frozen=True)
class Partition:
    """What `sinfo` says of a partition's nodes: the most CPUs, memory (MiB) and GPUs one node has."""

    name: str
    cpus: int
    memory_mb: int
    gpus: int


def _gres_gpus(gres: str) -> int:
    """GPUs in an sinfo %G field: "gpu:4", "gpu:a100:8(S:0-1)", "gpu:2,shard:8", "(null)" -> 4, 8, 2, 0."""
    n = 0
    for part in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", part.strip())
        if m:
            n += int(m.group(1))
    return n


def sinfo_partitions() -> dict[str, Partition] | None:
    """{partition: Partition} from `sinfo` (the default partition also under the key None), or None where sinfo
    is missing or does not answer (then the partition and node sizes are not checked before submission)."""
    out = _run(["sinfo", "-h", "-o", "%P|%c|%m|%G"])
    if out is None:
        return None
    parts: dict = {}
    for line in out.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 4:
            continue
        name, cpus, mem, gres = fields
        default = name.endswith("*")
        name = name.rstrip("*")
        num = lambda t: int(re.match(r"\d*", t).group() or 0)  # noqa: E731 - "8+" / "64000+" when nodes differ
        old = parts.get(name, Partition(name, 0, 0, 0))
        p = Partition(name, max(old.cpus, num(cpus)), max(old.memory_mb, num(mem)), max(old.gpus, _gres_gpus(gres)))
        parts[name] = p
        if default:
            parts[None] = p
    return parts


# ----- the jobs -----

def log_directory(cfg: Config) -> str:
    """Where the jobs write their output: `cluster.log_directory`, else `<run_root>/slurm-logs` (absolute)."""
    return os.path.abspath(os.path.expanduser(cfg.cluster.log_directory or os.path.join(cfg.run_root, "slurm-logs")))


def default_prologue() -> list[str]:
    """Shell lines that activate this driver's virtual environment (none outside one). The workers run this
    driver's python (`sys.executable`) either way; the nodes must see the same path (a shared file system)."""
    if sys.prefix == sys.base_prefix:
        return []
    return [f"source {shlex.quote(os.path.join(sys.prefix, 'bin', 'activate'))}"]


def _exports(env: dict[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]


def job_specs(cfg: Config) -> list[JobSpec]:
    """The jobs the config asks for: `num_env_workers` env jobs, then `gpu_jobs` GPU jobs (module docstring).

    Raises:
        VulkanMissingError (tasks.envs.maniskill.vulkan): the simulator's processes need a Vulkan driver and none is
        found on this machine (`tasks.envs.worker_env`: the env jobs get the same environment as local workers).
    """
    from dask.utils import parse_bytes

    from tasks.envs import worker_env
    c = cfg.cluster
    logs = log_directory(cfg)
    prologue = default_prologue() if c.job_script_prologue is None else list(c.job_script_prologue)
    base = {"queue": c.partition, "account": c.account, "walltime": c.walltime, "interface": c.interface,
            "job_directives_skip": list(c.job_directives_skip), "python": sys.executable, "nanny": True,
            "death_timeout": 60, "protocol": None, "security": None, "config_name": "slurm", "log_directory": None}
    out_lines = [f"-o {logs}/%x-%j.out", f"-e {logs}/%x-%j.err"]
    quiet = {"MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env_env = {"OMP_NUM_THREADS": "1", **quiet, **worker_env(cfg.env)}
    jobs = [JobSpec(f"env-{i}", "env", 1, {
        **base, "cores": c.threads_per_worker, "processes": 1, "memory": c.memory_limit, "job_cpu": c.env_job_cores,
        "job_name": f"dagrl-env-{i}", "job_extra_directives": [*out_lines, *c.job_extra_directives],
        "job_script_prologue": [*prologue, *_exports(env_env)], "worker_extra_args": ["--resources", "CPU=1"]})
        for i in range(c.num_env_workers)]
    G = c.gpus_per_job
    gpu_env = {"OMP_NUM_THREADS": str(max(1, c.gpu_job_cores // G)), "OMP_WAIT_POLICY": "PASSIVE", **quiet}
    gres = [f"--gres=gpu:{G}"] if c.gpu_nodes else []
    cuda = {"worker_command": "dask cuda worker"} if c.gpu_nodes else {}  # python -m dask cuda worker (dask-cuda)
    jobs += [JobSpec(f"gpu-{j}", "gpu", G, {
        **base, "cores": c.threads_per_worker * G, "processes": G, "memory": parse_bytes(c.memory_limit) * G,
        "job_cpu": c.gpu_job_cores, "job_name": f"dagrl-gpu-{j}",
        "job_extra_directives": [*out_lines, *gres, *c.job_extra_directives],
        "job_script_prologue": [*prologue, *_exports(gpu_env)], "worker_extra_args": ["--resources", "GPU=1"],
        **cuda}) for j in range(c.gpu_jobs)]
    return jobs


def job_scripts(cfg: Config, scheduler: str | None = None) -> list[tuple[str, str]]:
    """(job name, batch script) of every job, as dask-jobqueue writes them (`job_script()`); `scheduler`: the
    scheduler's address (default a placeholder: it is known once the scheduler runs). Submits nothing."""
    from pipelines.clusters.jobqueue import import_jobqueue
    SLURMJob = import_jobqueue().SLURMJob
    where = scheduler or f"tcp://{cfg.cluster.host or 'SCHEDULER'}:PORT"
    return [(j.name, job_script(SLURMJob, j, where)) for j in job_specs(cfg)]


# ----- the kind's interface -----

def check_machine(cfg: Config, cuda_count: int) -> None:
    """Raise PlacementError before submission for what the Slurm cluster cannot hold, where `sinfo` answers (else
    nothing is checked here): an unknown `cluster.partition` (listing the known ones), and a job asking for more
    GPUs (`gpus_per_job` with `gpu_nodes`), cores or memory than the partition's largest node has. Also
    `cluster.num_gpus` above the GPU workers the jobs start."""
    c = cfg.cluster
    if c.num_gpus is not None and c.num_gpus > c.gpu_workers:
        raise PlacementError("cluster.num_gpus", c.num_gpus,
                             f"the GPU jobs start {c.gpu_workers} GPU workers (cluster.gpu_jobs={c.gpu_jobs} x "
                             f"cluster.gpus_per_job={c.gpus_per_job}): raise cluster.gpu_jobs or lower num_gpus")
    parts = sinfo_partitions()
    if parts is None:
        return
    known = sorted(p for p in parts if p is not None)
    if c.partition is not None and c.partition not in parts:
        from tasks.config.errors import did_you_mean
        hint = did_you_mean(c.partition, known)
        raise PlacementError("cluster.partition", c.partition, f"Slurm has no such partition (sinfo lists {known})"
                                                               f"{'; ' + hint if hint else ''}; use one of them, or "
                                                               f"null for the default partition")
    p = parts.get(c.partition)
    if p is None:  # no default partition: sbatch will say so
        return
    where = f"the nodes of partition {p.name} (sinfo)"
    if c.gpu_nodes and c.gpus_per_job > p.gpus:
        raise PlacementError("cluster.gpus_per_job", c.gpus_per_job,
                             f"{where} have at most {p.gpus} GPUs; ask for at most {p.gpus} per job and more jobs "
                             f"(cluster.gpu_jobs), or use a partition with larger nodes")
    for key in ("env_job_cores", "gpu_job_cores"):
        if p.cpus and getattr(c, key) > p.cpus:
            raise PlacementError(f"cluster.{key}", getattr(c, key), f"{where} have at most {p.cpus} CPUs; ask for "
                                                                    f"at most {p.cpus}")
    from dask.utils import parse_bytes
    job_mb = parse_bytes(c.memory_limit) * c.gpus_per_job / 2**20
    if p.memory_mb and job_mb > p.memory_mb and not any("--mem" in s for s in c.job_directives_skip):
        raise PlacementError("cluster.memory_limit", c.memory_limit,
                             f"a GPU job asks for {job_mb:.0f} MiB (memory_limit x gpus_per_job), {where} have at "
                             f"most {p.memory_mb} MiB; lower cluster.memory_limit or cluster.gpus_per_job")


def devices(cfg: Config, cuda_count: int) -> tuple[int, str]:
    """(devices, where the number comes from) with `cluster.num_gpus` null: the GPU jobs' workers."""
    c = cfg.cluster
    return c.gpu_workers, f"cluster.gpu_jobs={c.gpu_jobs} x cluster.gpus_per_job={c.gpus_per_job}"


def env_served(cfg: Config, n: int) -> None:
    """Unknown before the jobs run: which env worker serves which device follows the nodes they land on."""
    return None


def rejoin(cfg: Config) -> tuple[int, float]:
    """(workers of the whole cluster, seconds to wait for them after a loss): a lost job is submitted again
    (jobqueue.JobWatch), so the wait is the start's: `start_timeout_s` (queue wait included) + 30 s."""
    c = cfg.cluster
    return c.num_env_workers + c.gpu_workers, c.start_timeout_s + 30.0


def describe(cfg: Config, num_devices: int | None) -> str:
    """For `pipelines.validate`: one line naming the jobs, then the batch script of each kind of job (the env jobs'
    and the GPU jobs' differ only in their names), as `sbatch` would get them."""
    c = cfg.cluster
    many = "s" if c.gpus_per_job != 1 else ""
    gpus = f"GPU{many} (--gres, dask cuda worker)" if c.gpu_nodes else f"logical GPU{many}"
    head = (f"slurm, {c.num_env_workers} env jobs (CPU) + {c.gpu_jobs} GPU job{'s' if c.gpu_jobs != 1 else ''} of "
            f"{c.gpus_per_job} {gpus}; partition {c.partition or '(default)'}, walltime {c.walltime}; "
            f"job scripts (pipelines.run submits them with sbatch):")
    lines, seen = [head], set()
    for name, script in job_scripts(cfg):
        role = name.split("-")[0]
        if role in seen:
            continue
        seen.add(role)
        same = [j.name for j in job_specs(cfg) if j.role == role]
        lines.append(f"    --- {name}" + (f" (also {', '.join(same[1:])}: the same but the name)" if len(same) > 1
                                           else ""))
        lines += [f"    {line}" for line in script.rstrip().splitlines()]
    return "\n".join(lines)


def attach(cfg: Config):
    """No cluster exists before `start` submits the jobs: ConfigError naming cluster.kind (`--connect` checks an
    existing scheduler)."""
    raise ConfigError("cluster.kind", "slurm", "--connect checks an existing cluster: pipelines.validate prints "
                                               "the job scripts without it; give cluster.kind=address "
                                               "cluster.address=tcp://HOST:PORT for a scheduler already running")


def _command_age_s() -> float | None:
    """Seconds since this process started (the command), or None when unknown."""
    try:
        import psutil
        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - only for the line
        return None


def _close_after_failure(cluster, client) -> None:
    """Cancel every job submitted so far and stop the scheduler."""
    if client is not None:
        ClusterHandle(client, cluster, "").close()
    else:
        cluster.close(timeout=60)


def start(cfg: Config, echo=None) -> ClusterHandle:
    """Submit the jobs (`job_specs`) into one dask-jobqueue cluster whose scheduler runs here, wait for every
    worker (`jobqueue.wait_for_jobs`: a progress line whenever it changes), print the time from the command to all
    workers joined, and start the job watch (a job that leaves the queue is submitted again).

    Raises:
        PlacementError (a ConfigError) before submission: what the Slurm cluster cannot hold (`check_machine`,
        through the placement check).
        ConnectionError (one line): sbatch refused a job, a job ended before its worker joined, or not every worker
        joined within `cluster.start_timeout_s` (naming the jobs still pending and squeue's reason). Every job
        submitted is cancelled first, also when interrupted.
    """
    import logging

    import dask
    from distributed import Client

    from pipelines.clusters.jobqueue import import_jobqueue
    jq = import_jobqueue()
    SLURMCluster, SLURMJob = jq.SLURMCluster, jq.SLURMJob

    from pipelines.clusters.placement import check_placement
    echo = echo or (lambda line: print(line, flush=True))
    c = cfg.cluster
    check_placement(cfg, 0)  # check_machine (sinfo) and the placement, before anything is submitted
    jobs = job_specs(cfg)
    os.makedirs(log_directory(cfg), exist_ok=True)
    sched = {"dashboard_address": c.dashboard_address, **({"host": c.host} if c.host else {})}
    with dask.config.set(scheduler_config(cfg)):
        cluster = cluster_class(SLURMCluster)(n_workers=0, cores=1, memory=c.memory_limit, interface=c.interface,
                                              scheduler_options=sched, silence_logs=logging.ERROR)
    job_cls = job_class(SLURMJob)
    cluster.worker_spec = {j.name: j.spec(job_cls) for j in jobs}
    submitted = time.monotonic()
    client = None
    try:
        try:
            cluster.sync(cluster._correct_state)
        except RuntimeError as exc:  # Job._call: sbatch exited non-zero
            err = [ln for ln in str(exc).splitlines() if ln.strip()]
            why = next((ln for ln in err if "error" in ln.lower()), err[-1] if err else str(exc))
            raise ConnectionError(f"sbatch refused a job of the slurm cluster ({why.strip()}); check "
                                  f"cluster.partition, cluster.account and cluster.job_extra_directives "
                                  f"(pipelines.validate cluster=slurm prints the job scripts)") from None
        client = Client(cluster)
        took = wait_for_jobs(cluster, client, jobs, timeout_s=c.start_timeout_s, queue=squeue, what="slurm",
                             timeout_key="cluster.start_timeout_s", echo=echo, submitted=submitted,
                             logs=log_directory(cfg))
    except BaseException:
        _close_after_failure(cluster, client)
        raise
    n = sum(len(j.worker_names) for j in jobs)
    age = _command_age_s()
    echo(f"dagrl: slurm: all {n} workers of {len(jobs)} jobs joined {took:.1f} s after submission"
         + (f" ({age:.1f} s after the command)" if age is not None else ""))
    watch = JobWatch(cluster, squeue, "slurm", echo)
    watch.start()
    cluster.dagrl_job_watch = watch  # tests read what it replaced
    return ClusterHandle(client, cluster, client.dashboard_link)
