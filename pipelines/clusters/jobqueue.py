"""What a batch-scheduler cluster kind does with dask-jobqueue (pipelines/clusters/batch.py uses it): one SpecCluster
whose scheduler runs in this driver and whose workers are batch jobs, one job per worker name the placement needs;
waiting for the jobs' workers with a progress line; re-submitting a job that ended while the run goes on; cancelling
every job when the cluster closes.

The jobs (`JobSpec`, built by the kind from its config):
  env-i   one CPU job per env worker, its worker started with `--resources CPU=1`;
  gpu-j   one GPU job per `cluster.gpu_jobs`, holding `cluster.gpus_per_job` workers `gpu-j-k` (`gpu-j` with one GPU),
          each started with `--resources GPU=1`: on GPU nodes through `dask cuda worker` (one worker per GPU,
          CUDA_VISIBLE_DEVICES set by dask-cuda), elsewhere plain workers whose GPU is logical (as the embedded
          cluster's `gpu-i` on a CPU-only machine).
The worker names are what the placement orders by (pipelines.clusters.placement.natural_order): GPU device i is the
i-th GPU worker by name, whichever job holds it.

A job that leaves the queue (cancelled with `scancel`, preempted, past its walltime, failed) while the cluster runs is
noticed by a watch on the cluster's event loop (`JobWatch`, every `WATCH_S`), which submits a replacement job under
the same worker name(s); the run's recovery (pipelines.runner.recovery) waits for the cluster's workers
(`rejoin` of the kind) and retries the step on the replacement. Closing the cluster cancels every job it submitted
(dask-jobqueue's `Job.close`: the scheduler's cancel command).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable


def import_jobqueue(module: str = "dask_jobqueue.slurm"):
    """Import a dask-jobqueue module without its side effect on this process: dask-jobqueue 0.9's `runner`
    (imported by its package) replaces the SIGINT handler with `sys.exit()` at import time, which would turn the
    driver's Ctrl-C (checkpoint the step, one line; pipelines.cli) into a bare exit. The handler in place before
    the import is put back. Returns the module.

    Raises:
        ImportError: dask-jobqueue is not installed (it is a dependency of dagrl: reinstall with scripts/setup.sh).
    """
    import importlib
    import signal
    import threading
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        return importlib.import_module(module)
    finally:
        if main and signal.getsignal(signal.SIGINT) is not before:
            signal.signal(signal.SIGINT, before)

logger = logging.getLogger(__name__)

WATCH_S = 2.0  # how often the job watch asks the queue whether a job ended


@dataclass(frozen=True)
class JobSpec:
    """One batch job of the cluster.

    name: the job's worker name (`env-0`, `gpu-1`); a job with several workers names them `<name>-<k>`.
    role: "env" (CPU worker) or "gpu" (GPU workers).
    workers: dask workers the job starts (processes; one per GPU for a GPU job).
    options: keyword arguments of the dask-jobqueue Job class (cores, memory, job_extra_directives, ...).
    """

    name: str
    role: str
    workers: int
    options: dict = field(default_factory=dict)

    @property
    def worker_names(self) -> list[str]:
        """The dask worker names this job's workers register under (dask's `--nworkers` / dask-cuda's naming)."""
        return [self.name] if self.workers == 1 else [f"{self.name}-{k}" for k in range(self.workers)]

    def spec(self, job_cls) -> dict:
        """The SpecCluster worker-spec entry of this job (with `group` for a multi-worker job, as
        dask-jobqueue's JobQueueCluster writes it)."""
        out = {"cls": job_cls, "options": dict(self.options)}
        if self.workers > 1:
            out["group"] = [f"-{k}" for k in range(self.workers)]
        return out


def job_script(job_cls, job: JobSpec, scheduler: str = "tcp://SCHEDULER:PORT") -> str:
    """The batch script dask-jobqueue would submit for `job` (`Job.job_script()`), with `scheduler` standing for the
    scheduler's address (known once it runs). Nothing is submitted or created."""
    return job_cls(scheduler, name=job.name, **job.options).job_script()


@dataclass
class QueueState:
    """A job as the batch scheduler lists it: state (PENDING, RUNNING, ...) and the reason it waits (squeue %r)."""

    state: str
    reason: str = ""


def _joined(client) -> set[str]:
    from pipelines.clusters.info import cluster_info
    return {str(w.get("name")) for w in cluster_info(client)["workers"].values()}


def _job_ids(cluster) -> dict[str, str]:
    """job name -> its batch job id (None before it is submitted)."""
    return {str(n): getattr(j, "job_id", None) for n, j in cluster.workers.items()}


def wait_for_jobs(cluster, client, jobs: list[JobSpec], *, timeout_s: float, queue: Callable[[list[str]], dict],
                  what: str, timeout_key: str, echo=print, submitted: float | None = None, logs: str = "",
                  no_reason: str = "") -> float:
    """Wait until every worker of `jobs` has joined the scheduler, printing a progress line whenever it changes
    (`<what>: jobs P pending, R running; workers joined J/N`).

    Args:
        cluster: the SpecCluster whose `workers` are the submitted Job objects (their `job_id`).
        queue: job ids -> {job id: QueueState} for the jobs still in the queue (an ended job is absent), or None
            when the queue does not answer.
        what: the scheduler's name for the lines ("slurm"); timeout_key: the config key of `timeout_s`.
        submitted: time.monotonic() of the submission (default: now). logs: where the jobs write their output.
        no_reason: said after the jobs still waiting when the queue gives no reason a job waits (SGE's qstat).
    Returns:
        seconds from `submitted` until every worker joined.
    Raises:
        ConnectionError (one line): not every worker joined within `timeout_s` (naming each job still waiting, its
        state and the queue's reason), or a job left the queue before its workers joined (naming it and its id).
    """
    t0 = time.monotonic() if submitted is None else submitted
    names = {j.name: j.worker_names for j in jobs}
    want = sum(len(v) for v in names.values())
    last = None
    while True:
        joined = _joined(client)
        ids = _job_ids(cluster)
        asked = queue([i for i in ids.values() if i]) if any(ids.values()) else {}
        states = asked or {}  # None: the queue did not answer (no job is taken for ended then)
        waiting = {n: ids.get(n) for n, ws in names.items() if not set(ws) <= joined}
        n_joined = sum(len(set(ws) & joined) for ws in names.values())
        pending = sum(1 for i in ids.values() if i in states and states[i].state == "PENDING")
        running = sum(1 for i in ids.values() if i in states and states[i].state == "RUNNING")
        line = f"dagrl: {what}: jobs {pending} pending, {running} running; workers joined {n_joined}/{want}"
        if line != last:
            echo(line)
            last = line
        if not waiting:
            return time.monotonic() - t0
        gone = [n for n, i in waiting.items() if i and asked is not None and i not in states]
        if gone:
            n = gone[0]
            raise ConnectionError(f"{what} job {ids[n]} ({n}) ended before its worker joined the scheduler; see its "
                                  f"log{' in ' + logs if logs else ''} (cluster.log_directory) for why (a python or "
                                  f"venv the nodes cannot reach, a scheduler address they cannot connect to: "
                                  f"cluster.interface)")
        if time.monotonic() - t0 > timeout_s:
            parts = [f"{n} (job {i}: {states[i].state}" + (f", {states[i].reason}" if states[i].reason
                                                           and states[i].reason != "None" else "") + ")"
                     if i in states else f"{n} (job {i})" if i else f"{n} (not submitted)"
                     for n, i in waiting.items()]
            raise ConnectionError(f"{timeout_key}={timeout_s:g}: {n_joined} of {want} workers joined within "
                                  f"{timeout_s:g} s; still waiting: {', '.join(parts)}"
                                  f"{' (' + no_reason + ')' if no_reason else ''}; raise {timeout_key} for a "
                                  f"busy queue, or ask for less (fewer jobs, fewer cores or less memory per job, a "
                                  f"shorter walltime, another partition)")
        time.sleep(1.0)


class JobWatch:
    """Re-submits, under the same worker name(s), every job of `cluster` that left the queue while the cluster runs
    (cancelled, preempted, past its walltime, failed), one line each; stops when the cluster closes. Runs on the
    cluster's event loop every WATCH_S seconds; `queue` as `wait_for_jobs`'s (called in a thread)."""

    def __init__(self, cluster, queue: Callable[[list[str]], dict], what: str, echo=print):
        self.cluster, self.queue, self.what, self.echo = cluster, queue, what, echo
        self.replaced: list[tuple[str, str]] = []  # (job name, the ended job's id), in order
        self._task = None

    def start(self) -> None:
        async def begin():
            self._task = asyncio.ensure_future(self._run())
        self.cluster.sync(begin)

    async def _run(self) -> None:
        from distributed.core import Status
        while self.cluster.status == Status.running:
            await asyncio.sleep(WATCH_S)
            try:
                await self.check()
            except Exception as exc:  # noqa: BLE001 - a failed query is tried again at the next tick
                logger.debug("job watch: %s", exc)

    def describe(self, names: list[str]) -> str:
        """One clause on the jobs that held workers `names` (a job's workers are named after it: `gpu-0`,
        `gpu-0-1`) and left the queue: "<what> job ID (NAME) left the queue, replaced by job NEW" (the latest loss
        of each), joined by ", "; '' when none of them did."""
        last = dict(self.replaced)  # job name -> the id that ended last
        out = []
        for job in sorted({j for j in last for n in names if n == j or n.startswith(f"{j}-")}):
            new = getattr(self.cluster.workers.get(job), "job_id", None)
            out.append(f"{self.what} job {last[job]} ({job}) left the queue, "
                       + (f"replaced by job {new}" if new else "not replaced"))
        return ", ".join(out)

    async def check(self) -> list[str]:
        """One look: the names of the jobs it re-submitted."""
        from distributed.core import Status
        c = self.cluster
        ids = {n: j.job_id for n, j in list(c.workers.items()) if getattr(j, "job_id", None)}
        if not ids or c.status != Status.running:
            return []
        states = await asyncio.get_running_loop().run_in_executor(None, self.queue, list(ids.values()))
        if states is None or c.status != Status.running:
            return []
        ended = [n for n, i in ids.items() if i not in states and c.workers.get(n) is not None
                 and c.workers[n].job_id == i]
        from distributed.deploy.spec import ProcessInterface
        for n in ended:
            self.replaced.append((str(n), ids[n]))
            await ProcessInterface.close(c.workers.pop(n))  # closed (nothing to cancel); still in worker_spec:
            # the next _correct_state submits it again
        if ended:
            await c._correct_state()
            new = {n: getattr(c.workers.get(n), "job_id", None) for n in ended}
            self.echo(f"dagrl: {self.what}: job(s) {', '.join(f'{ids[n]} ({n})' for n in ended)} left the queue; "
                      f"submitted replacement(s) {', '.join(f'{new[n]} ({n})' for n in ended)}")
        return [str(n) for n in ended]


def job_class(base):
    """A subclass of dask-jobqueue's Job class `base` whose `close` (the scheduler's cancel command) also marks the
    job closed, as SpecCluster expects of every worker it made when it closes (dask-jobqueue 0.9's `Job.close`
    leaves it `running`, and SpecCluster's close then fails its assertion for any job still referenced, e.g. by an
    exception's traceback after a failed start)."""
    from distributed.deploy.spec import ProcessInterface

    class DagrlJob(base):
        async def close(self):
            try:
                await super().close()
            finally:
                await ProcessInterface.close(self)

    DagrlJob.__name__ = DagrlJob.__qualname__ = f"Dagrl{base.__name__}"
    return DagrlJob


def cluster_class(base):
    """A subclass of dask-jobqueue's cluster class `base` whose lost workers are left to `JobWatch`: SpecCluster
    closes the job of a worker gone for `distributed.deploy.lost-worker-timeout` (15 s), which would cancel a
    replacement still waiting in the queue under the same name."""
    from distributed.deploy.cluster import Cluster

    class DagrlJobCluster(base):
        def _update_worker_status(self, op, msg):
            Cluster._update_worker_status(self, op, msg)

    DagrlJobCluster.__name__ = DagrlJobCluster.__qualname__ = f"Dagrl{base.__name__}"
    return DagrlJobCluster
