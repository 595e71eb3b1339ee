"""What the batch-scheduler kinds (`cluster.kind` slurm, pbs, lsf, sge) share: their config keys
(`BatchClusterConfig`), the one description of a scheduler each kind gives (`BatchSystem`: dask-jobqueue's job and
cluster classes, how the queue/account/walltime/cores/memory/GPU directives are spelt, the queue listing and its
parse, the cancel command, what the scheduler cannot tell), and every step built from it: the config's rules
(`check`), the jobs the placement asks for (`job_specs`, pipelines.clusters.jobqueue.JobSpec), their batch scripts
(`job_scripts`, dask-jobqueue's `job_script()`), `pipelines.validate`'s description, and `start` (submit, wait with a
progress line, watch the queue: pipelines.clusters.jobqueue). A kind's module (slurm.py, pbs.py, lsf.py, sge.py)
holds its registered config class, its `BatchSystem` and its queue parse, and binds the interface with
`kind_interface`.

The jobs (every scheduler): `num_env_workers` CPU jobs `env-i` (one worker, resource `CPU=1`, `env_job_cores`
cores, `memory_limit`) and `gpu_jobs` GPU jobs `gpu-j` of `gpus_per_job` workers (resource `GPU=1` each,
`gpu_job_cores` cores, `memory_limit` x `gpus_per_job`). With `gpu_nodes: true` a GPU job asks the scheduler for its
GPUs (the system's GPU directive) and starts its workers with `dask cuda worker`; with `false` its GPUs are logical.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional

from pipelines.clusters.errors import PlacementError
from pipelines.clusters.jobqueue import JobSpec, QueueState
from pipelines.clusters.tls import tls_enabled
from tasks.config import Config, ConfigError
from tasks.config.schema import ClusterConfig


@dataclass(frozen=True)
class BatchClusterConfig(ClusterConfig):
    """The keys every batch-scheduler kind has (conf/cluster/<kind>.yaml); each kind's class adds its queue and
    account keys under the scheduler's own names (slurm: partition/account, pbs: queue/account, lsf and sge:
    queue/project) and what only its scheduler has. Not registered itself."""

    num_env_workers: int = 2  # CPU jobs env-i, one env worker each (resource CPU=1)
    gpu_jobs: int = 1  # GPU jobs gpu-j
    gpus_per_job: int = 1  # GPUs of a GPU job: one worker each (resource GPU=1); asked for with gpu_nodes
    gpu_nodes: bool = False  # the GPU jobs' nodes have GPUs: the GPU directive, `dask cuda worker`; false: logical
    env_job_cores: int = 1  # cores of an env job
    gpu_job_cores: int = 1  # cores of a GPU job (the actor's torch threads: these / gpus_per_job)
    walltime: str = "01:00:00"  # the jobs' time limit in the scheduler's form; >= runner.max_wall_time_s
    job_extra_directives: list[str] = field(default_factory=list)  # more directive lines (without the prefix)
    job_directives_skip: list[str] = field(default_factory=list)  # generated directives to drop (substrings)
    job_script_prologue: Optional[list[str]] = None  # shell lines before the worker; null: activate this venv
    interface: Optional[str] = None  # network interface of the scheduler and the workers (e.g. ib0); null: default
    host: Optional[str] = None  # the scheduler's address to bind (e.g. 127.0.0.1 on a one-node cluster); null: any
    dashboard_address: str = ":8787"  # the scheduler's dashboard
    log_directory: Optional[str] = None  # the jobs' output; null: <run_root>/<kind>-logs
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


@dataclass(frozen=True)
class JobNeed:
    """What one job asks of the scheduler, for a system's `options`: its name (`env-0`), role ("env" | "gpu"),
    cores, memory (bytes, the whole job), GPUs (0 unless a GPU job on `gpu_nodes`) and its log directory."""

    name: str
    role: str
    cores: int
    memory: int
    gpus: int
    logs: str


@dataclass(frozen=True)
class BatchSystem:
    """One batch scheduler as dagrl drives it through dask-jobqueue (module docstring).

    kind: `cluster.kind` and the name in the lines ("slurm"); title: the scheduler's name ("Slurm").
    module, job, cluster: the dask-jobqueue module and its Job and JobQueueCluster class names.
    prefix: the directive prefix ("#SBATCH"); submit, cancel: the commands dask-jobqueue runs (for the lines).
    queue_key, account_key: the kind's config keys of the queue (partition) and the account (project), or None.
    options(cfg, need) -> (Job keyword arguments, directives): how the queue, account, walltime, cores, memory and
        GPUs of one job are spelt (the user's `job_extra_directives` follow the directives).
    queue(job ids) -> {job id: QueueState(PENDING | RUNNING | the scheduler's word, reason)} of the jobs still in
        the queue (an ended job absent), or None when the listing does not answer.
    walltime_s(text) -> seconds (ValueError naming the forms); format_walltime(seconds) -> text.
    gpu_words: how a GPU job asks for its GPUs, for `describe` ("--gres"); None: the scheduler has no standard GPU
        directive (gpu_nodes then needs the kind's GPU key: `gpu_key`).
    gpu_key: the kind's key naming the site's GPU resource, when `gpu_words` is None.
    check_nodes(cfg): refusals from the scheduler's own view of its nodes (Slurm's sinfo), or None.
    no_reason: what to say when the queue gives no reason a job waits ("" when it does).
    """

    kind: str
    title: str
    module: str
    job: str
    cluster: str
    prefix: str
    submit: str
    cancel: str
    queue_key: str
    account_key: Optional[str]
    options: Callable[[Config, JobNeed], tuple[dict, list[str]]]
    queue: Callable[[list[str]], Optional[dict]]
    walltime_s: Callable[[str], float]
    format_walltime: Callable[[float], str]
    gpu_words: Optional[str] = None
    gpu_key: Optional[str] = None
    check_nodes: Optional[Callable[[Config], None]] = None
    no_reason: str = ""

    def job_class(self):
        """dask-jobqueue's Job class of this scheduler (imported without its SIGINT side effect)."""
        from pipelines.clusters.jobqueue import import_jobqueue
        return getattr(import_jobqueue(self.module), self.job)

    def cluster_class(self):
        from pipelines.clusters.jobqueue import import_jobqueue
        return getattr(import_jobqueue(self.module), self.cluster)


# ----- time limits and commands -----

def hms_walltime_s(text: str) -> float:
    """Seconds of a PBS / SGE time limit `[[HH:]MM:]SS` (qsub(1) -l walltime, h_rt): "3600", "60:00", "01:00:00"
    -> 3600. Raises ValueError naming the form."""
    parts = str(text).strip().split(":")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError("not a time limit of the form [[HH:]MM:]SS (seconds alone are seconds)")
    s = 0
    for p in parts:
        s = s * 60 + int(p)
    return float(s)


def format_hms(seconds: float) -> str:
    """Seconds (rounded up to a whole minute) as HH:MM:SS (hours beyond 24 kept: PBS and SGE read them)."""
    s = int(-(-float(seconds) // 60) * 60)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:00"


def run_command(args: list[str], timeout: float = 30.0, empty_if: str | None = None) -> str | None:
    """stdout of a scheduler command, or None when it is not installed, fails or does not answer in time;
    `empty_if`: a failure whose output holds this text is an empty answer (LSF's "No unfinished job found")."""
    if shutil.which(args[0]) is None:
        return None
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if empty_if is not None and empty_if in (p.stdout or "") + (p.stderr or ""):
        return ""
    return p.stdout if p.returncode == 0 else None


# ----- the config's rules -----

def check(cfg: Config, system: BatchSystem) -> None:
    """A batch kind's rules (ConfigError naming the key and the fix): positive job counts, cores and start timeout,
    at least one core per GPU worker, a `memory_limit` dask can read, a walltime in the scheduler's form no shorter
    than `runner.max_wall_time_s`, GPUs on nodes only where the scheduler can be asked for them, and no TLS."""
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
        wall = system.walltime_s(c.walltime)
    except ValueError as exc:
        raise ConfigError("cluster.walltime", c.walltime, str(exc)) from None
    limit = cfg.runner.max_wall_time_s
    if limit is not None and wall < limit:
        raise ConfigError("cluster.walltime", c.walltime,
                          f"is {wall:g} s, shorter than runner.max_wall_time_s={limit:g}: {system.title} would end "
                          f"the jobs mid-run; set cluster.walltime={system.format_walltime(limit)} or more, or "
                          f"lower runner.max_wall_time_s")
    if c.gpu_nodes and system.gpu_words is None and not getattr(c, system.gpu_key or "", None):
        raise ConfigError("cluster.gpu_nodes", True,
                          f"{system.title} has no standard GPU request: name your site's GPU resource with "
                          f"cluster.{system.gpu_key} (e.g. gpu), or set cluster.gpu_nodes=false for logical GPUs")
    if tls_enabled(c.security):
        raise ConfigError("cluster.security", "TLS", f"cluster.kind={system.kind} does not set up TLS yet: drop "
                                                     "cluster.security, or start the jobs yourself and use "
                                                     "cluster.kind=address with TLS")


# ----- the jobs -----

def log_directory(cfg: Config) -> str:
    """Where the jobs write their output: `cluster.log_directory`, else `<run_root>/<kind>-logs` (absolute)."""
    c = cfg.cluster
    return os.path.abspath(os.path.expanduser(c.log_directory or os.path.join(cfg.run_root, f"{c.kind}-logs")))


def default_prologue() -> list[str]:
    """Shell lines that activate this driver's virtual environment (none outside one). The workers run this
    driver's python (`sys.executable`) either way; the nodes must see the same path (a shared file system)."""
    if sys.prefix == sys.base_prefix:
        return []
    return [f"source {shlex.quote(os.path.join(sys.prefix, 'bin', 'activate'))}"]


def _exports(env: dict[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]


def job_specs(cfg: Config, system: BatchSystem) -> list[JobSpec]:
    """The jobs the config asks for: `num_env_workers` env jobs, then `gpu_jobs` GPU jobs (module docstring), each
    with the system's directives (`BatchSystem.options`) followed by `job_extra_directives`.

    Raises:
        VulkanMissingError (tasks.envs.maniskill.vulkan): the simulator's processes need a Vulkan driver and none is
        found on this machine (`tasks.envs.worker_env`: the env jobs get the same environment as local workers).
    """
    from dask.utils import parse_bytes

    from tasks.envs import worker_env
    c = cfg.cluster
    logs = log_directory(cfg)
    prologue = default_prologue() if c.job_script_prologue is None else list(c.job_script_prologue)
    base = {"interface": c.interface, "job_directives_skip": list(c.job_directives_skip), "python": sys.executable,
            "nanny": True, "death_timeout": 60, "protocol": None, "security": None, "config_name": system.kind,
            "log_directory": None}
    quiet = {"MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env_env = {"OMP_NUM_THREADS": "1", **quiet, **worker_env(cfg.env)}
    mem = parse_bytes(c.memory_limit)

    def options(need: JobNeed) -> dict:
        kw, directives = system.options(cfg, need)
        return {**base, **kw, "job_name": f"dagrl-{need.name}",
                "job_extra_directives": [*directives, *c.job_extra_directives]}
    jobs = [JobSpec(f"env-{i}", "env", 1, {
        **options(JobNeed(f"env-{i}", "env", c.env_job_cores, mem, 0, logs)),
        "cores": c.threads_per_worker, "processes": 1, "memory": c.memory_limit,
        "job_script_prologue": [*prologue, *_exports(env_env)], "worker_extra_args": ["--resources", "CPU=1"]})
        for i in range(c.num_env_workers)]
    G = c.gpus_per_job
    gpu_env = {"OMP_NUM_THREADS": str(max(1, c.gpu_job_cores // G)), "OMP_WAIT_POLICY": "PASSIVE", **quiet}
    cuda = {"worker_command": "dask cuda worker"} if c.gpu_nodes else {}  # python -m dask cuda worker (dask-cuda)
    jobs += [JobSpec(f"gpu-{j}", "gpu", G, {
        **options(JobNeed(f"gpu-{j}", "gpu", c.gpu_job_cores, mem * G, G if c.gpu_nodes else 0, logs)),
        "cores": c.threads_per_worker * G, "processes": G, "memory": mem * G,
        "job_script_prologue": [*prologue, *_exports(gpu_env)], "worker_extra_args": ["--resources", "GPU=1"],
        **cuda}) for j in range(c.gpu_jobs)]
    return jobs


def job_scripts(cfg: Config, system: BatchSystem, scheduler: str | None = None) -> list[tuple[str, str]]:
    """(job name, batch script) of every job, as dask-jobqueue writes them (`job_script()`); `scheduler`: the
    scheduler's address (default a placeholder: it is known once the scheduler runs). Submits nothing."""
    from pipelines.clusters.jobqueue import job_script
    job_cls = system.job_class()
    where = scheduler or f"tcp://{cfg.cluster.host or 'SCHEDULER'}:PORT"
    return [(j.name, job_script(job_cls, j, where)) for j in job_specs(cfg, system)]


# ----- the kind's interface, for any system -----

def check_machine(cfg: Config, cuda_count: int, system: BatchSystem) -> None:
    """Raise PlacementError before submission: `cluster.num_gpus` above the GPU workers the jobs start, and what the
    scheduler's own view of its nodes refuses (`BatchSystem.check_nodes`, where the kind has one)."""
    c = cfg.cluster
    if c.num_gpus is not None and c.num_gpus > c.gpu_workers:
        raise PlacementError("cluster.num_gpus", c.num_gpus,
                             f"the GPU jobs start {c.gpu_workers} GPU workers (cluster.gpu_jobs={c.gpu_jobs} x "
                             f"cluster.gpus_per_job={c.gpus_per_job}): raise cluster.gpu_jobs or lower num_gpus")
    if system.check_nodes is not None:
        system.check_nodes(cfg)


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


def describe(cfg: Config, num_devices: int | None, system: BatchSystem) -> str:
    """For `pipelines.validate`: one line naming the jobs, then the batch script of each kind of job (the env jobs'
    and the GPU jobs' differ only in their names), as the submit command would get them."""
    c = cfg.cluster
    many = "s" if c.gpus_per_job != 1 else ""
    gpus = (f"GPU{many} ({system.gpu_words or 'cluster.' + str(system.gpu_key)}, dask cuda worker)" if c.gpu_nodes
            else f"logical GPU{many}")
    head = (f"{system.kind}, {c.num_env_workers} env jobs (CPU) + {c.gpu_jobs} GPU job"
            f"{'s' if c.gpu_jobs != 1 else ''} of {c.gpus_per_job} {gpus}; {system.queue_key} "
            f"{getattr(c, system.queue_key) or '(default)'}, walltime {c.walltime}; job scripts (pipelines.run "
            f"submits them with {system.submit}):")
    specs = job_specs(cfg, system)
    lines, seen = [head], set()
    for name, script in job_scripts(cfg, system):
        role = name.split("-")[0]
        if role in seen:
            continue
        seen.add(role)
        same = [j.name for j in specs if j.role == role]
        lines.append(f"    --- {name}" + (f" (also {', '.join(same[1:])}: the same but the name)" if len(same) > 1
                                           else ""))
        lines += [f"    {line}" for line in script.rstrip().splitlines()]
    return "\n".join(lines)


def attach(cfg: Config):
    """No cluster exists before `start` submits the jobs: ConfigError naming cluster.kind (`--connect` checks an
    existing scheduler)."""
    raise ConfigError("cluster.kind", cfg.cluster.kind, "--connect checks an existing cluster: pipelines.validate "
                                                        "prints the job scripts without it; give cluster.kind=address "
                                                        "cluster.address=tcp://HOST:PORT for a scheduler already "
                                                        "running")


def _command_age_s() -> float | None:
    """Seconds since this process started (the command), or None when unknown."""
    try:
        import psutil
        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - only for the line
        return None


def _close_after_failure(cluster, client) -> None:
    """Cancel every job submitted so far and stop the scheduler."""
    from pipelines.clusters.handle import ClusterHandle
    if client is not None:
        ClusterHandle(client, cluster, "").close()
    else:
        cluster.close(timeout=60)


def start(cfg: Config, system: BatchSystem, echo=None):
    """Submit the jobs (`job_specs`) into one dask-jobqueue cluster whose scheduler runs here, wait for every
    worker (`jobqueue.wait_for_jobs`: a progress line whenever it changes), print the time from the command to all
    workers joined, and start the job watch (a job that leaves the queue is submitted again).

    Raises:
        PlacementError (a ConfigError) before submission: what the cluster cannot hold (`check_machine`, through
        the placement check).
        ConnectionError (one line): the submit command refused a job, a job ended before its worker joined, or not
        every worker joined within `cluster.start_timeout_s` (naming the jobs still pending and the queue's reason
        where it gives one). Every job submitted is cancelled first, also when interrupted.
    """
    import logging

    import dask
    from distributed import Client

    from pipelines.clusters.handle import ClusterHandle, scheduler_config
    from pipelines.clusters.jobqueue import JobWatch, cluster_class, job_class, wait_for_jobs
    from pipelines.clusters.placement import check_placement
    echo = echo or (lambda line: print(line, flush=True))
    c = cfg.cluster
    check_placement(cfg, 0)  # check_machine and the placement, before anything is submitted
    jobs = job_specs(cfg, system)
    logs = log_directory(cfg)
    os.makedirs(logs, exist_ok=True)
    sched = {"dashboard_address": c.dashboard_address, **({"host": c.host} if c.host else {})}
    with dask.config.set(scheduler_config(cfg)):
        cluster = cluster_class(system.cluster_class())(n_workers=0, cores=1, memory=c.memory_limit,
                                                        interface=c.interface, scheduler_options=sched,
                                                        silence_logs=logging.ERROR)
    job_cls = job_class(system.job_class())
    cluster.worker_spec = {j.name: j.spec(job_cls) for j in jobs}
    submitted = time.monotonic()
    client = None
    try:
        try:
            cluster.sync(cluster._correct_state)
        except RuntimeError as exc:  # Job._call: the submit command exited non-zero
            err = [ln for ln in str(exc).splitlines() if ln.strip()]
            why = next((ln for ln in err if "error" in ln.lower()), err[-1] if err else str(exc))
            keys = [f"cluster.{k}" for k in (system.queue_key, system.account_key) if k]
            raise ConnectionError(f"{system.submit} refused a job of the {system.kind} cluster ({why.strip()}); "
                                  f"check {', '.join(keys)} and cluster.job_extra_directives "
                                  f"(pipelines.validate cluster={system.kind} prints the job scripts)") from None
        client = Client(cluster)
        took = wait_for_jobs(cluster, client, jobs, timeout_s=c.start_timeout_s, queue=system.queue,
                             what=system.kind, timeout_key="cluster.start_timeout_s", echo=echo, submitted=submitted,
                             logs=logs, no_reason=system.no_reason)
    except BaseException:
        _close_after_failure(cluster, client)
        raise
    n = sum(len(j.worker_names) for j in jobs)
    age = _command_age_s()
    echo(f"dagrl: {system.kind}: all {n} workers of {len(jobs)} jobs joined {took:.1f} s after submission"
         + (f" ({age:.1f} s after the command)" if age is not None else ""))
    watch = JobWatch(cluster, system.queue, system.kind, echo)
    watch.start()
    cluster.dagrl_job_watch = watch  # tests (and the recovery's line) read what it replaced
    return ClusterHandle(client, cluster, client.dashboard_link)


def kind_interface(system: BatchSystem) -> tuple:
    """The `pipelines.clusters.ClusterKind` functions of a batch kind bound to its `system`, in this order: start,
    check_machine, devices, env_served, rejoin, describe, attach (a kind's module assigns them in one line)."""
    def _start(cfg: Config, echo=None):
        return start(cfg, system, echo)

    def _check_machine(cfg: Config, cuda_count: int) -> None:
        check_machine(cfg, cuda_count, system)

    def _describe(cfg: Config, num_devices: int | None) -> str:
        return describe(cfg, num_devices, system)
    for fn, of in ((_start, start), (_check_machine, check_machine), (_describe, describe)):
        fn.__doc__, fn.__name__ = of.__doc__, of.__name__
    return _start, _check_machine, devices, env_served, rejoin, _describe, attach


__all__ = ["BatchClusterConfig", "BatchSystem", "JobNeed", "QueueState", "check", "job_specs", "job_scripts",
           "kind_interface", "log_directory", "run_command"]
