"""`cluster.kind=sge` (conf/cluster/sge.yaml): the workers are (Son of / Univa / Altair) Grid Engine batch jobs
(dask-jobqueue's SGEJob) this driver submits with `qsub`, its Dask scheduler running in the driver; every job is
cancelled (`qdel`) when the run ends, is interrupted or fails. The jobs, the waiting and the job watch are every
batch kind's (pipelines.clusters.batch).

Grid Engine's spelling: `#$ -q queue`, `-P project`, `-l h_rt=[[HH:]MM:]SS` (the walltime), `-pe
<parallel_environment> N` for a job of N > 1 cores, `-l <memory_resource>=<M>M` (per slot, as h_vmem and mem_free
count: the job's memory / its cores, rounded up to MiB), output to `-o <log directory>/` (`-j y`: one file). Grid
Engine has no standard GPU request: a GPU job on GPU nodes asks `-l <gpu_resource>=G`, the complex your site defines
(`qconf -sc`; a per-job consumable), and `gpu_nodes` is refused without it. The queue is read with `qstat -xml` (this
user's jobs): a state with q or w is pending, with r or t running, with E in error, with d being deleted (ended).
`qstat -xml` gives no reason a job waits: the start's timeout names the jobs and their state only and says so
(`qstat -j ID` shows the scheduler's reasons where `schedd_job_info` is on). Not checked before submission: the
queue's existence and the hosts' sizes (qsub refuses them, said in one line).
"""
from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from typing import Optional

from pipelines.clusters import batch
from pipelines.clusters.batch import BatchClusterConfig, BatchSystem, JobNeed, format_hms, hms_walltime_s
from pipelines.clusters.batch import run_command as _run
from pipelines.clusters.checks import check_cluster
from pipelines.clusters.jobqueue import QueueState
from pipelines.clusters.tls import TLS_FILES
from tasks.config import Config, ConfigError, register_family


def check_sge(cfg: Config) -> None:
    """`cluster.kind=sge`'s rules (pipelines.clusters.batch.check), and a parallel environment for jobs of several
    cores (ConfigError naming the key and the fix)."""
    batch.check(cfg, SYSTEM)
    c = cfg.cluster
    if not c.parallel_environment and max(c.env_job_cores, c.gpu_job_cores) > 1:
        key = "env_job_cores" if c.env_job_cores > 1 else "gpu_job_cores"
        raise ConfigError("cluster.parallel_environment", c.parallel_environment,
                          f"a job of several cores (cluster.{key}={getattr(c, key)}) needs Grid Engine's parallel "
                          f"environment: name it (`qconf -spl` lists them, e.g. smp)")


@register_family("cluster", "sge", checks=(check_cluster, check_sge))
@dataclass(frozen=True)
class SGEClusterConfig(BatchClusterConfig):
    """`cluster` with `kind: sge` (conf/cluster/sge.yaml): the keys every batch kind has
    (pipelines.clusters.batch.BatchClusterConfig; walltime `[[HH:]MM:]SS`), Grid Engine's queue and project, and
    the site's names of the parallel environment and the memory and GPU resources."""

    kind: str = "sge"
    queue: Optional[str] = None  # -q; null: any queue
    project: Optional[str] = None  # -P; null: the default project
    parallel_environment: Optional[str] = "smp"  # -pe NAME N for jobs of N > 1 cores (qconf -spl)
    memory_resource: Optional[str] = "h_vmem"  # -l NAME=<per slot>M; null: no memory request
    gpu_resource: Optional[str] = None  # -l NAME=G for GPU jobs on gpu_nodes (qconf -sc); null: none (required then)


TLS_ROLES = TLS_FILES  # refused by the batch checks for now


def _options(cfg: Config, need: JobNeed) -> tuple[dict, list[str]]:
    """SGEJob's arguments and the #$ lines of one job (module docstring)."""
    c = cfg.cluster
    spec = [f"{c.memory_resource}={-(-need.memory // (need.cores * 2**20))}M"] if c.memory_resource else []
    spec += [f"{c.gpu_resource}={need.gpus}"] if need.gpus else []
    pe = [f"-pe {c.parallel_environment} {need.cores}"] if need.cores > 1 else []
    return ({"queue": c.queue, "project": c.project, "walltime": c.walltime,
             "resource_spec": ",".join(spec) or None}, [f"-o {need.logs}/", *pe])


def _state(code: str, job_id: str) -> QueueState | None:
    """QueueState of a qstat state code ("qw", "hqw", "r", "t", "Eqw", "dr", ...), None for an ended one."""
    if "d" in code:
        return None
    if "E" in code:
        return QueueState("ERROR", f"state {code}: qstat -j {job_id} says why, qmod -cj {job_id} clears it")
    if "r" in code or "t" in code:
        return QueueState("RUNNING")
    if "q" in code or "w" in code:
        return QueueState("PENDING")
    return QueueState(code)


def qstat_xml(job_ids: list[str]) -> dict[str, QueueState] | None:
    """{job id: QueueState} of `job_ids` still in Grid Engine's queue, from `qstat -xml` (every `job_list` element:
    JB_job_number, state), or None when qstat does not answer or its XML does not parse. No reasons (module
    docstring)."""
    out = _run(["qstat", "-xml"])
    if out is None:
        return None
    try:
        root = ElementTree.fromstring(out) if out.strip() else None
    except ElementTree.ParseError:
        return None
    want = {str(i) for i in job_ids}
    states = {}
    for job in ([] if root is None else root.iter("job_list")):
        i, code = (job.findtext("JB_job_number") or "").strip(), (job.findtext("state") or "").strip()
        st = _state(code, i) if i in want else None
        if st is not None:
            states[i] = st
    return states


SYSTEM = BatchSystem(
    kind="sge", title="Grid Engine", module="dask_jobqueue.sge", job="SGEJob", cluster="SGECluster", prefix="#$",
    submit="qsub", cancel="qdel", queue_key="queue", account_key="project", options=_options, queue=qstat_xml,
    walltime_s=hms_walltime_s, format_walltime=format_hms, gpu_key="gpu_resource",
    no_reason="Grid Engine's qstat -xml gives no reason a job waits: qstat -j ID may")
start, check_machine, devices, env_served, rejoin, describe, attach = batch.kind_interface(SYSTEM)
