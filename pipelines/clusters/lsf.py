"""`cluster.kind=lsf` (conf/cluster/lsf.yaml): the workers are IBM Spectrum LSF batch jobs (dask-jobqueue's LSFJob)
this driver submits with `bsub`, its Dask scheduler running in the driver; every job is cancelled (`bkill`) when the
run ends, is interrupted or fails. The jobs, the waiting and the job watch are every batch kind's
(pipelines.clusters.batch).

LSF's spelling: `#BSUB -q queue`, `-P project`, `-W [HH:]MM` (the walltime), `-n N` with `-R "span[hosts=1]"` (the
job's cores on one host), `-M` (the job's memory in `lsf_units`, dask-jobqueue's: LSF_UNIT_FOR_LIMITS of lsf.conf
when null), `-gpu "num=G"` for a GPU job on GPU nodes (LSF 10.1), output to `<log directory>/<job>-%J.out/.err`.
The queue is read with `bjobs -noheader -o "jobid stat pend_reason delimiter='|'"` (LSF 10.1): PEND and WAIT are
pending, RUN running, DONE and EXIT ended; a pending job's reason is bjobs' pend_reason. Not checked before
submission: the queue's existence and the hosts' sizes (bsub refuses them, said in one line).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipelines.clusters import batch
from pipelines.clusters.batch import BatchClusterConfig, BatchSystem, JobNeed
from pipelines.clusters.batch import run_command as _run
from pipelines.clusters.checks import check_cluster
from pipelines.clusters.jobqueue import QueueState
from pipelines.clusters.tls import TLS_FILES
from tasks.config import Config, register_family


def check_lsf(cfg: Config) -> None:
    """`cluster.kind=lsf`'s rules (pipelines.clusters.batch.check: ConfigError naming the key and the fix)."""
    batch.check(cfg, SYSTEM)


@register_family("cluster", "lsf", checks=(check_cluster, check_lsf))
@dataclass(frozen=True)
class LSFClusterConfig(BatchClusterConfig):
    """`cluster` with `kind: lsf` (conf/cluster/lsf.yaml): the keys every batch kind has
    (pipelines.clusters.batch.BatchClusterConfig; walltime `[HH:]MM`), and LSF's queue, project and memory unit."""

    kind: str = "lsf"
    walltime: str = "01:00"  # -W [HH:]MM; >= runner.max_wall_time_s
    queue: Optional[str] = None  # -q; null: the default queue
    project: Optional[str] = None  # -P; null: the default project
    lsf_units: Optional[str] = None  # -M's unit (kb, mb, gb, ...): LSF_UNIT_FOR_LIMITS; null: read from lsf.conf


TLS_ROLES = TLS_FILES  # refused by the batch checks for now


def walltime_s(text: str) -> float:
    """Seconds of an LSF run limit `[HH:]MM` (bsub -W): "90" -> 5400, "1:30" -> 5400. Raises ValueError naming
    the form."""
    parts = str(text).strip().split(":")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        raise ValueError("not an LSF run limit: use [HH:]MM (minutes alone are minutes)")
    return float((int(parts[0]) * 60 + int(parts[1]) if len(parts) == 2 else int(parts[0])) * 60)


def format_walltime(seconds: float) -> str:
    """Seconds (rounded up to a whole minute) as LSF's HH:MM."""
    m = int(-(-float(seconds) // 60))
    return f"{m // 60:02d}:{m % 60:02d}"


def _options(cfg: Config, need: JobNeed) -> tuple[dict, list[str]]:
    """LSFJob's arguments and the #BSUB lines of one job (module docstring)."""
    c = cfg.cluster
    kw = {"queue": c.queue, "project": c.project, "walltime": c.walltime, "ncpus": need.cores, "mem": need.memory,
          "lsf_units": c.lsf_units}
    out = [f"-o {need.logs}/{need.name}-%J.out", f"-e {need.logs}/{need.name}-%J.err"]
    return kw, [*out, *([f'-gpu "num={need.gpus}"'] if need.gpus else [])]


PENDING, RUNNING, ENDED = {"PEND", "WAIT"}, {"RUN"}, {"DONE", "EXIT"}  # bjobs(1) job states; others as LSF says


def bjobs(job_ids: list[str]) -> dict[str, QueueState] | None:
    """{job id: QueueState} of `job_ids` still in LSF's queue, from `bjobs -noheader -o "jobid stat pend_reason
    delimiter='|'"` (this user's unfinished jobs; "No unfinished job found" is an empty queue), or None when bjobs
    does not answer. An ended job (DONE, EXIT, or absent) is left out."""
    out = _run(["bjobs", "-noheader", "-o", "jobid stat pend_reason delimiter='|'"], empty_if="No unfinished job")
    if out is None:
        return None
    want = {str(i) for i in job_ids}
    states = {}
    for line in out.splitlines():
        i, _, rest = line.strip().partition("|")
        stat, _, reason = rest.partition("|")
        if i not in want or stat in ENDED:
            continue
        word = "PENDING" if stat in PENDING else "RUNNING" if stat in RUNNING else stat
        states[i] = QueueState(word, "" if reason.strip() == "-" else reason.strip())
    return states


SYSTEM = BatchSystem(
    kind="lsf", title="LSF", module="dask_jobqueue.lsf", job="LSFJob", cluster="LSFCluster", prefix="#BSUB",
    submit="bsub", cancel="bkill", queue_key="queue", account_key="project", options=_options, queue=bjobs,
    walltime_s=walltime_s, format_walltime=format_walltime, gpu_words='-gpu "num=N"')
start, check_machine, devices, env_served, rejoin, describe, attach = batch.kind_interface(SYSTEM)
