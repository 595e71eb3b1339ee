"""`cluster.kind=slurm` (conf/cluster/slurm.yaml): the workers are Slurm batch jobs (dask-jobqueue's SLURMJob) that
this driver submits with `sbatch`, its Dask scheduler running in the driver; every job is cancelled (`scancel`) when
the run ends, is interrupted or fails.

The placement decides the jobs (pipelines.clusters.batch, from this module's `SYSTEM`: the #SBATCH spellings,
squeue's listing, sinfo's refusals; pipelines.clusters.jobqueue runs them): `num_env_workers` CPU jobs `env-i`
(worker resource `CPU=1`, `env_job_cores` cores) and `gpu_jobs` GPU jobs `gpu-j` of `gpus_per_job` workers each (resource `GPU=1` per
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

import re
from dataclasses import dataclass
from typing import Optional

from pipelines.clusters import batch
from pipelines.clusters.batch import BatchClusterConfig, BatchSystem, JobNeed
from pipelines.clusters.batch import run_command as _run
from pipelines.clusters.checks import check_cluster
from pipelines.clusters.errors import PlacementError
from pipelines.clusters.jobqueue import JobSpec, QueueState
from pipelines.clusters.tls import TLS_FILES
from tasks.config import Config, register_family


def check_slurm(cfg: Config) -> None:
    """`cluster.kind=slurm`'s rules (ConfigError naming the key and the fix): positive job counts, cores and start
    timeout, at least one core per GPU worker, a `memory_limit` dask can read, a Slurm walltime no shorter than
    `runner.max_wall_time_s`, and no TLS (not supported by this kind yet). (pipelines.clusters.batch.check)"""
    batch.check(cfg, SYSTEM)


@register_family("cluster", "slurm", checks=(check_cluster, check_slurm))
@dataclass(frozen=True)
class SlurmClusterConfig(BatchClusterConfig):
    """`cluster` with `kind: slurm` (conf/cluster/slurm.yaml): the batch jobs this driver submits (the keys every
    batch kind has: pipelines.clusters.batch.BatchClusterConfig; cores are --cpus-per-task, walltime -t in Slurm's
    forms MM, HH:MM:SS, D-HH:MM:SS, ...)."""

    kind: str = "slurm"
    partition: Optional[str] = None  # -p; null: the cluster's default partition
    account: Optional[str] = None  # -A; null: the user's default account


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

def _options(cfg: Config, need: JobNeed) -> tuple[dict, list[str]]:
    """SLURMJob's arguments and the #SBATCH lines of one job: -p, -A, -t, --cpus-per-task, --mem (dask-jobqueue,
    from the job's memory), the output files (`%x-%j.out/.err` under the log directory) and `--gres=gpu:N`."""
    c = cfg.cluster
    kw = {"queue": c.partition, "account": c.account, "walltime": c.walltime, "job_cpu": need.cores}
    out = [f"-o {need.logs}/%x-%j.out", f"-e {need.logs}/%x-%j.err"]
    return kw, [*out, *([f"--gres=gpu:{need.gpus}"] if need.gpus else [])]


def log_directory(cfg: Config) -> str:
    """Where the jobs write their output: `cluster.log_directory`, else `<run_root>/slurm-logs` (absolute)."""
    return batch.log_directory(cfg)


def job_specs(cfg: Config) -> list[JobSpec]:
    """The jobs the config asks for: `num_env_workers` env jobs, then `gpu_jobs` GPU jobs (module docstring;
    pipelines.clusters.batch.job_specs, which names what it raises)."""
    return batch.job_specs(cfg, SYSTEM)


def job_scripts(cfg: Config, scheduler: str | None = None) -> list[tuple[str, str]]:
    """(job name, batch script) of every job, as dask-jobqueue writes them (`job_script()`); `scheduler`: the
    scheduler's address (default a placeholder: it is known once the scheduler runs). Submits nothing."""
    return batch.job_scripts(cfg, SYSTEM, scheduler)


# ----- the kind's interface -----

def check_nodes(cfg: Config) -> None:
    """Raise PlacementError before submission for what the Slurm cluster cannot hold, where `sinfo` answers (else
    nothing is checked here): an unknown `cluster.partition` (listing the known ones), and a job asking for more
    GPUs (`gpus_per_job` with `gpu_nodes`), cores or memory than the partition's largest node has."""
    c = cfg.cluster
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


SYSTEM = BatchSystem(
    kind="slurm", title="Slurm", module="dask_jobqueue.slurm", job="SLURMJob", cluster="SLURMCluster",
    prefix="#SBATCH", submit="sbatch", cancel="scancel", queue_key="partition", account_key="account",
    options=_options, queue=squeue, walltime_s=walltime_s, format_walltime=format_walltime, gpu_words="--gres",
    check_nodes=check_nodes)
start, check_machine, devices, env_served, rejoin, describe, attach = batch.kind_interface(SYSTEM)
