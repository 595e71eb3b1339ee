"""What every cluster kind shares once started: the handle the driver holds (`ClusterHandle`, closed quietly), the
driver's console logging while a cluster runs, and the dask config a scheduler that dagrl starts is created under
(`scheduler_config`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tasks.config import Config


@dataclass
class ClusterHandle:
    """A started or connected cluster: `client` (a distributed Client), `cluster` (the processes this driver
    started and must close, e.g. the embedded SpecCluster; None for an existing scheduler), the dashboard link
    to print and `note`: one line the command prints on stderr once the cluster is up (None: nothing to say), e.g.
    the embedded dashboard's port fallback (pipelines.clusters.local.dashboard_note)."""

    client: object
    cluster: object | None
    dashboard_link: str
    note: str | None = None

    def lost_jobs(self, names: list[str]) -> str:
        """What the cluster's job watch says of the batch jobs that held workers `names` and left the queue (the
        job, its replacement: pipelines.clusters.jobqueue.JobWatch.describe), '' for a cluster without jobs."""
        watch = getattr(self.cluster, "dagrl_job_watch", None)
        return watch.describe(names) if watch is not None else ""

    def close(self) -> None:
        """Close the client and, for the embedded cluster, its processes. On a starved machine a nanny may not
        stop its worker within distributed's few seconds; that is not an error of the run (the processes are
        killed anyway), so close timeouts are swallowed. Closing logs nothing: the run has said what it had to (an
        `error:` line stays the last line on stderr), so the driver's, the nannies' and the workers'
        distributed/tornado loggers are silenced first (heartbeats to a closing scheduler fail with tracebacks
        otherwise)."""
        _silence_close_logs(self.client if self.cluster is not None else None)
        try:
            self.client.close()
        except (TimeoutError, OSError):
            pass
        finally:
            if self.cluster is not None:
                try:
                    self.cluster.close(timeout=60)
                except (TimeoutError, OSError):
                    pass


_CLOSE_LOGGERS = ("distributed", "tornado", "tornado.application", "asyncio")  # distributed sets tornado.application
# to error itself, so the parent's level does not reach it


def _quiet_logs() -> None:
    """Set the loggers that report a cluster's shutdown to CRITICAL in this process."""
    for name in _CLOSE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _silence_close_logs(client, wait_s: float = 5.0) -> None:
    """`_quiet_logs` here and, with `client` (an embedded cluster's), on its workers and nannies, waiting at most
    `wait_s` (a paused or dying worker must not hold up the close)."""
    import threading
    _quiet_logs()
    if client is None:
        return

    def run() -> None:
        for nanny in (False, True):
            try:
                client.run(_quiet_logs, nanny=nanny, on_error="ignore")
            except Exception:  # noqa: BLE001 - best effort: a closing cluster may refuse
                pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(wait_s)


def quiet_driver_logs() -> None:
    """Before a cluster starts or is connected: distributed's loggers in this process at ERROR, and the records of
    failures the driver reports itself off its console (`pipelines.worker_preload.route_reported_failures`; the
    embedded scheduler and an in-process worker log into this console)."""
    for name in ("distributed", "distributed.nanny", "distributed.scheduler", "distributed.worker",
                 "distributed.core", "distributed.http.proxy"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from pipelines.worker_preload import route_reported_failures
    route_reported_failures()


DASK_WORKER_TTL_S = 300.0  # distributed's default `distributed.scheduler.worker-ttl` (5 minutes)
TTL_MARGIN_S = 60.0  # the watch's own report comes this long before the scheduler would drop a silent worker


def scheduler_config(cfg: Config) -> dict:
    """The dask config the embedded scheduler is created under (`start_cluster`):

    * `distributed.scheduler.http.routes`: `scheduler_http_routes()` (a serialisable `/json/identity.json`);
    * `distributed.scheduler.worker-ttl`: max(distributed's 300 s, `runner.stall_timeout_s` + 60 s). The scheduler
      removes a worker it has not heard from for worker-ttl, and the run then counts it "lost (left the cluster or
      restarted)"; a worker that is only slow (a starved event loop on an oversubscribed machine) must not be
      dropped before the watch (pipelines.runner.watcher) says it was "not heard from" in its own line naming
      runner.stall_timeout_s, so the scheduler's bound follows the watch's.
    """
    ttl = max(DASK_WORKER_TTL_S, float(cfg.runner.stall_timeout_s) + TTL_MARGIN_S)
    return {"distributed.scheduler.http.routes": scheduler_http_routes(),
            "distributed.scheduler.worker-ttl": f"{ttl:g}s"}


def scheduler_http_routes() -> list[str]:
    """distributed's `distributed.scheduler.http.routes` with its JSON routes replaced by `pipelines.dashboard_json`
    (the embedded scheduler's `/json/identity.json` answered 500 with a traceback in the driver's console)."""
    import dask

    from pipelines import dashboard_json
    return [dashboard_json.__name__ if m == dashboard_json.REPLACES else m
            for m in dask.config.get("distributed.scheduler.http.routes")]

