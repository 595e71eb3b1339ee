"""`cluster.kind=pbs` (conf/cluster/pbs.yaml): the workers are PBS batch jobs (dask-jobqueue's PBSJob) this driver
submits with `qsub`, its Dask scheduler running in the driver; every job is cancelled (`qdel`) when the run ends, is
interrupted or fails. The jobs, the waiting and the job watch are every batch kind's (pipelines.clusters.batch).

PBS's spelling (PBS Pro / OpenPBS): `#PBS -q queue`, `-A account`, `-l walltime=[[HH:]MM:]SS`, one chunk
`-l select=1:ncpus=N:mem=M` (cores and the job's memory) with `:ngpus=G` for a GPU job on GPU nodes, output to
`-o/-e <log directory>/`. The queue is read with `qstat -f -F json` (OpenPBS / PBS Pro 19 and later): `job_state`
Q, H, W, T are pending, R and B running, E and F ended; a pending job's reason is its `comment`. Torque's qstat has no
JSON output: there the queue does not answer, so the start waits without job states and a job that leaves the queue
is not re-submitted (its loss is the run's recovery's as on an existing cluster). Not checked before submission: the
queue's existence and the nodes' sizes (PBS has no sinfo; qsub refuses them, said in one line).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from pipelines.clusters import batch
from pipelines.clusters.batch import BatchClusterConfig, BatchSystem, JobNeed, format_hms, hms_walltime_s
from pipelines.clusters.batch import run_command as _run
from pipelines.clusters.checks import check_cluster
from pipelines.clusters.jobqueue import QueueState
from pipelines.clusters.tls import TLS_FILES
from tasks.config import Config, register_family


def check_pbs(cfg: Config) -> None:
    """`cluster.kind=pbs`'s rules (pipelines.clusters.batch.check: ConfigError naming the key and the fix)."""
    batch.check(cfg, SYSTEM)


@register_family("cluster", "pbs", checks=(check_cluster, check_pbs))
@dataclass(frozen=True)
class PBSClusterConfig(BatchClusterConfig):
    """`cluster` with `kind: pbs` (conf/cluster/pbs.yaml): the keys every batch kind has
    (pipelines.clusters.batch.BatchClusterConfig; walltime `[[HH:]MM:]SS`), and PBS's queue and account."""

    kind: str = "pbs"
    queue: Optional[str] = None  # -q; null: the server's default queue
    account: Optional[str] = None  # -A; null: none


TLS_ROLES = TLS_FILES  # refused by the batch checks for now


def _options(cfg: Config, need: JobNeed) -> tuple[dict, list[str]]:
    """PBSJob's arguments and the #PBS lines of one job (module docstring): -q, -A, -l walltime, -l select with
    ncpus, mem (dask-jobqueue's PBS size: KiB-based kB/MB/GB, rounded up) and ngpus, and the output directory."""
    from pipelines.clusters.jobqueue import import_jobqueue
    size = import_jobqueue("dask_jobqueue.pbs").pbs_format_bytes_ceil
    c = cfg.cluster
    select = f"select=1:ncpus={need.cores}:mem={size(need.memory)}" + (f":ngpus={need.gpus}" if need.gpus else "")
    return ({"queue": c.queue, "account": c.account, "walltime": c.walltime, "resource_spec": select},
            [f"-o {need.logs}/", f"-e {need.logs}/"])


PENDING, RUNNING, ENDED = set("QHWT"), set("RB"), set("EFX")  # qstat(1B) job states; others (S, U) as PBS says


def qstat(job_ids: list[str]) -> dict[str, QueueState] | None:
    """{job id: QueueState} of `job_ids` still in PBS's queue, from `qstat -f -F json` (its "Jobs" object: keys
    "<id>.<server>", fields job_state and comment), or None when qstat does not answer or its JSON does not parse.
    An ended job (E, F, X, or absent) is left out."""
    out = _run(["qstat", "-f", "-F", "json"])
    if out is None:
        return None
    try:
        jobs = json.loads(out, strict=False).get("Jobs", {}) if out.strip() else {}
    except (ValueError, AttributeError):
        return None
    want = {str(i) for i in job_ids}
    states = {}
    for key, job in jobs.items():
        i = str(key).split(".")[0]
        code = str(job.get("job_state", ""))
        if i not in want or code in ENDED:
            continue
        word = "PENDING" if code in PENDING else "RUNNING" if code in RUNNING else code
        states[i] = QueueState(word, str(job.get("comment", "")))
    return states


SYSTEM = BatchSystem(
    kind="pbs", title="PBS", module="dask_jobqueue.pbs", job="PBSJob", cluster="PBSCluster", prefix="#PBS",
    submit="qsub", cancel="qdel", queue_key="queue", account_key="account", options=_options, queue=qstat,
    walltime_s=hms_walltime_s, format_walltime=format_hms, gpu_words="-l select=...:ngpus")
start, check_machine, devices, env_served, rejoin, describe, attach = batch.kind_interface(SYSTEM)
