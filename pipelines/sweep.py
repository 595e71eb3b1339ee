"""Sweeps, Hydra's way: `python -m pipelines.run -m seed=1,2,3 algorithm.lr=1e-4,3e-4 [conf=NAME] [key=value ...]`.

Hydra's multirun semantics for the sweep syntax: under `-m` (`--multirun`) every override whose value is a comma
list (or one of Hydra's sweep functions, `range(1,4)`) is swept, and the jobs are the cartesian product of the swept
values, the first swept key varying slowest (Hydra's BasicSweeper order); the other overrides go to every job.
Without `-m` a comma list stays refused in one line (pipelines.overrides). A swept value keeps the text typed
(`algorithm.lr=1e-4,3e-4`: `1e-4`, `3e-4`) where the list is plain; quoted or bracketed values are split by Hydra.

What a sweep does (`run_sweep`):
1. every job's config through `pipelines.config.load_config` before the first job starts: a job the checks refuse
   fails the sweep (exit 2, one line naming the job) before anything runs; `run_root`, `tracking.uri` and
   `runner.resume` cannot be swept (one store and one sweep directory per sweep; resume each run on its own);
2. the places it writes to checked once (`pipelines.cli.preflight`);
3. the sweep directory `<run_root>/sweeps/<sweep_id>/sweep.json` (the jobs, their overrides, swept values, run ids,
   status, exit code and one-line reason), rewritten atomically after every change;
4. the jobs one after another in this process (`pipelines.run`'s own training path), each MLflow run tagged
   `dagrl.sweep=<sweep_id>`, `dagrl.sweep.job=<index>` and `dagrl.swept.<key>=<value>` per swept key
   (storage.tracking.SWEEP_TAG). The cluster is started (or connected) once and handed to every job with the same
   cluster section, simulator and scheduler settings (`ClusterPool`: the embedded cluster's workers start once per
   sweep; each finished job's worker-resident objects are released; after a failed job the next one starts a new
   cluster).
5. a failed job does not stop the others; the end lists each job's status and the failed ones' one-line reason,
   and prints the report command (`python -m pipelines.compare --sweep ID`, pipelines.sweep_report).
   Exit 0 when every job finished, 1 when one failed (2: refused before anything ran).
Ctrl-C: the job in flight stops as `pipelines.run` stops (the step in flight, a checkpoint), no later job starts;
the sweep file says which jobs did not run; exit 130.

Side by side: `--jobs N` (`-j N`) on an existing cluster (`cluster.kind=address`) runs up to N jobs at once, each
in its own driver process, in slots pinned one job a device where the cluster's GPU workers allow it
(pipelines.sweep_jobs: slots, the job processes, signals, what two drivers on one cluster share). The other kinds
refuse `--jobs` in one line and run their jobs one after another as above.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from storage.tracking import SWEEP_TAG, SWEPT_TAG_PREFIX
from tasks.config import ConfigError

JOB_TAG = f"{SWEEP_TAG}.job"  # the job's index in the sweep
NOT_SWEPT = ("run_root", "tracking.uri", "runner.resume")  # one store and sweep dir per sweep; a resume is one run
SEED_KEY = "seed"  # the key the report pairs configurations over (pipelines.sweep_report)


@dataclass
class Job:
    """One job of a sweep: its `index`, the `overrides` it is composed from (as `pipelines.run` takes them) and its
    swept values `swept` {key: value as typed}; the rest is filled as it runs."""

    index: int
    overrides: list[str]
    swept: dict[str, str]
    status: str = "pending"  # pending | running | finished | failed | interrupted | not run
    exit_code: int | None = None
    reason: str | None = None  # a failed job's one line
    run_id: str | None = None
    run_dir: str | None = None
    mlflow_run_id: str | None = None
    experiment: str | None = None
    wall_s: float | None = None

    def label(self) -> str:
        """`seed=1 algorithm.lr=1e-4` (its swept values)."""
        return " ".join(f"{k}={v}" for k, v in self.swept.items()) or "(no swept key)"


@dataclass
class Sweep:
    """A sweep's record (`sweep.json`): id, the command's overrides, the swept keys in order, and its jobs."""

    sweep_id: str
    overrides: list[str]
    swept_keys: list[str]
    jobs: list[Job]
    run_root: str = ""
    tracking_uri: str = ""
    started: str = ""
    status: str = "pending"  # pending | running | finished | failed | interrupted
    extra: dict = field(default_factory=dict)

    def write(self, directory: Path) -> Path:
        """Write `directory/sweep.json` atomically (a temporary file renamed over it); returns its path."""
        directory.mkdir(parents=True, exist_ok=True)
        path, tmp = directory / "sweep.json", directory / "sweep.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: Path) -> "Sweep":
        """The sweep recorded in `path` (a sweep.json). Raises ValueError (one line) for a file that is not one."""
        try:
            d = json.loads(Path(path).read_text())
            return cls(**{**d, "jobs": [Job(**j) for j in d["jobs"]]})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a sweep record ({type(exc).__name__}: {exc}); a sweep directory "
                             f"holds the sweep.json `pipelines.run -m` wrote") from None


def sweep_dir(run_root: str | Path, sweep_id: str) -> Path:
    """`<run_root>/sweeps/<sweep_id>` (resolved)."""
    return Path(run_root).resolve() / "sweeps" / sweep_id


_PLAIN_LIST = re.compile(r"^[^'\"\[\]{}()\\]*$")  # a comma list without quotes, brackets, escapes or functions


def expand(overrides: Sequence[str]) -> tuple[list[Job], list[str]]:
    """The grid of a `-m` command line: (jobs in Hydra's BasicSweeper order, the swept keys in order).

    Each override is parsed with Hydra's grammar; a sweep override (`key=a,b`, `key=range(1,4)`, ...) contributes
    its values, every other override is given to every job as typed. A plain comma list is split on its commas so
    each value keeps its text (Hydra would turn `1e-4` into `0.0001`); others are Hydra's `sweep_string_iterator`.

    Raises:
        ConfigError: an override Hydra cannot parse (pipelines.overrides' line), a key swept twice, a key of
            NOT_SWEPT swept, or an empty sweep (`key=range(0)`).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from pipelines.overrides import _grammar_error
    parser = OverridesParser.create()
    choices, keys = [], []
    for text in overrides:
        key, _, value = text.lstrip("+~").partition("=")
        try:
            ov = parser.parse_override(text)
        except HydraException:
            raise _grammar_error(key, value) from None
        if not ov.is_sweep_override():
            choices.append([(None, text)])
            continue
        if ov.key_or_group in keys:
            raise ConfigError(ov.key_or_group, value, "is swept twice; give all its values in one list (key=a,b,c)")
        if ov.key_or_group in NOT_SWEPT:
            raise ConfigError(ov.key_or_group, value, "cannot be swept: a sweep's runs share one run_root and one "
                                                      "MLflow store, and a resume continues one run; give one value")
        raw = text.partition("=")[2]
        values = ([v.strip() for v in raw.split(",")] if _PLAIN_LIST.match(raw) and "," in raw
                  else list(ov.sweep_string_iterator()))
        if not values:
            raise ConfigError(ov.key_or_group, value, "sweeps no value; give at least one")
        keys.append(ov.key_or_group)
        choices.append([(ov.key_or_group, f"{ov.get_key_element()}={v}") for v in values])
    jobs = []
    for i, combo in enumerate(itertools.product(*choices)):
        swept = {k: t.partition("=")[2] for k, t in combo if k is not None}
        jobs.append(Job(index=i, overrides=[t for _, t in combo], swept=swept))
    return jobs, keys


def job_tags(sweep_id: str, job: Job) -> dict[str, str]:
    """The MLflow tags of a sweep's run: `dagrl.sweep`, `dagrl.sweep.job` and `dagrl.swept.<key>` per swept key."""
    return {SWEEP_TAG: sweep_id, JOB_TAG: str(job.index),
            **{f"{SWEPT_TAG_PREFIX}{k}": v for k, v in job.swept.items()}}


def tag_run(tracking_uri: str, run_id: str, sweep_id: str, swept: dict[str, str], index: int | None = None) -> int:
    """Tag the active MLflow runs of dagrl run `run_id` in `tracking_uri` as runs of sweep `sweep_id` with the
    swept values `swept` (`job_tags`), for runs a sweep did not start itself (benchmarks/recipe.py's RL stage), so
    that `pipelines.compare --sweep` reports them. Returns how many runs were tagged (0: no such run, or no store
    there)."""
    from mlflow.entities import RunTag, ViewType
    from mlflow.tracking import MlflowClient
    from storage.tracking import RUN_ID_TAG, check_tracking_uri
    try:
        check_tracking_uri(tracking_uri, must_exist=True)
    except ValueError:
        return 0
    client = MlflowClient(tracking_uri)
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    runs = client.search_runs(ids, filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'",
                              run_view_type=ViewType.ACTIVE_ONLY) if ids else []
    tags = job_tags(sweep_id, Job(-1 if index is None else index, [], dict(swept)))
    if index is None:
        tags.pop(JOB_TAG)
    for r in runs:
        client.log_batch(r.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    return len(runs)


class ClusterPool:
    """`start(cfg)` for `pipelines.cli.with_cluster` across a sweep's jobs: a cluster is started (the embedded one,
    Slurm jobs, a DaskCluster) or connected (an existing scheduler) once per layout (the cluster section, the
    simulator and its workers' environment, the scheduler's settings) and handed to every later job of that layout;
    `after_job` releases the finished job's worker-resident objects (its run id's keys: safe on a cluster other
    drivers share) and, after a job that failed, closes the cluster so that the next job starts from a new one. The
    handles it gives out close nothing; `close()` closes the kept cluster at the sweep's end."""

    def __init__(self):
        self._key, self._handle, self.started = None, None, 0

    @staticmethod
    def layout(cfg) -> str:
        """The key two jobs must share to share a cluster."""
        from pipelines.clusters import scheduler_config
        from tasks.envs import worker_env
        try:
            env = worker_env(cfg.env)
        except Exception as exc:  # noqa: BLE001 - the start itself reports it
            env = repr(exc)
        return repr((asdict(cfg.cluster), cfg.env.simulator, env, scheduler_config(cfg)))

    def start(self, cfg):
        from pipelines.clusters import ClusterHandle, start_cluster
        key = self.layout(cfg)
        if self._handle is not None and key != self._key:
            self.close()
        if self._handle is None:
            self._handle, self._key = start_cluster(cfg), key
            self.started += 1
        h = self._handle

        class _Kept(ClusterHandle):
            def close(self) -> None:  # the pool closes the real one (`ClusterPool.close`)
                pass
        return _Kept(h.client, h.cluster, h.dashboard_link)

    def after_job(self, run_id: str | None, ok: bool) -> None:
        """After a job: release its run's worker-resident objects (`tasks.resident.release` of `<run_id>/`), or
        close the cluster when the job failed (lost workers, a stalled scheduler: the next job starts afresh)."""
        if self._handle is None:
            return
        if not ok:
            self.close()
            return
        if run_id:
            from tasks import resident
            try:
                self._handle.client.run(resident.release, f"{run_id}/", on_error="ignore")
            except Exception:  # noqa: BLE001 - a cluster that cannot answer: start afresh
                self.close()

    def close(self) -> None:
        """Close the kept cluster (signals held: the close is not cut short)."""
        from pipelines.cli import held_signals
        if self._handle is not None:
            with held_signals():
                self._handle.close()
        self._handle, self._key = None, None


class _LastError:
    """A write-through copy of stderr that remembers the last `error: ...` / `interrupted ...` line (a failed job's
    one-line reason: `pipelines.cli.with_cluster` prints it)."""

    def __init__(self, stream):
        self.stream, self.line, self._buf = stream, None, ""

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for ln in lines:
            if ln.startswith(("error: ", "interrupted")):
                self.line = ln
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _load_all(jobs: list[Job]):
    """Every job's checked config (`load_config`), or (None, the error line) for the first one refused."""
    from pipelines.cli import check_interrupted
    from pipelines.config import load_config
    from tasks.envs.errors import SimulatorUnavailable
    cfgs = []
    for job in jobs:
        try:
            cfgs.append(load_config(job.overrides, command="run")[0])
        except (ConfigError, SimulatorUnavailable) as exc:
            return None, f"error: sweep job {job.index} ({job.label()}): {exc}; nothing was run"
        check_interrupted()
        if cfgs[-1].runner.resume is not None:
            return None, (f"error: sweep job {job.index}: runner.resume={cfgs[-1].runner.resume!r}: a sweep starts "
                          f"new runs; resume each run on its own (python -m pipelines.run runner.resume=RUN_ID)")
    return cfgs, None


def run_sweep(overrides: Sequence[str], *, train: Callable, show: bool = False, echo=print,
              jobs_at_once: int | None = None) -> int:
    """`python -m pipelines.run -m ...` (module docstring). `train(cfg, handle, tags=..., record=...) -> exit code`
    is pipelines.run's training path. `jobs_at_once`: `--jobs N`, the jobs side by side on an existing cluster
    (pipelines.sweep_jobs; refused in one line on another kind). Returns the exit code: 0 every job finished, 1 one
    failed, 2 refused before anything ran (one line on stderr), 130 interrupted."""
    from pipelines.cli import preflight, with_cluster
    from pipelines.config import to_yaml
    from pipelines.runner.setup import new_run_id, tracking_uri
    try:
        jobs, keys = expand(overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfgs, refused = _load_all(jobs)
    if cfgs is None:
        print(refused, file=sys.stderr)
        return 2
    if show:
        for job, cfg in zip(jobs, cfgs):
            echo(f"# sweep job {job.index}: {job.label()}\n{to_yaml(cfg)}")
        return 0
    side = None
    if jobs_at_once is not None:  # before anything is written: not an existing cluster, or one that does not answer
        from pipelines.sweep_jobs import prepare
        client, slots, refused = prepare(cfgs, jobs_at_once)
        if refused is not None:
            print(refused, file=sys.stderr)
            return 2
        side = (client, slots)
    for place in {(c.run_root, c.tracking.uri): c for c in cfgs}.values():
        if not preflight(place):
            if side is not None:
                side[0].close()
            return 2
    sweep = Sweep(new_run_id(), list(overrides), keys, jobs, run_root=str(Path(cfgs[0].run_root).resolve()),
                  tracking_uri=tracking_uri(cfgs[0]), started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  status="running")
    where = sweep_dir(cfgs[0].run_root, sweep.sweep_id)
    sweep.write(where)
    echo(f"dagrl: sweep {sweep.sweep_id}: {len(jobs)} job(s) over {', '.join(keys) or 'no swept key'} | "
         f"{where / 'sweep.json'}", flush=True)
    if side is not None:
        from pipelines.sweep_jobs import run_side_by_side
        return run_side_by_side(sweep, where, cfgs, *side, job_tags=job_tags, summary=summary, echo=echo)
    pool = ClusterPool()
    interrupted = False
    try:
        for job, cfg in zip(jobs, cfgs):
            echo(f"dagrl: sweep {sweep.sweep_id} job {job.index + 1}/{len(jobs)}: {job.label()}", flush=True)
            job.status, job.experiment = "running", cfg.experiment
            sweep.write(where)
            rc = _run_job(job, cfg, train, pool, job_tags(sweep.sweep_id, job), with_cluster)
            sweep.write(where)
            if rc == 130:
                interrupted = True
                break
    except KeyboardInterrupt:  # between jobs, or while a cluster started or closed
        interrupted = True
        for job in jobs:
            if job.status == "running":
                job.status, job.exit_code, job.reason = "interrupted", 130, "interrupted"
    finally:
        pool.close()
        for job in jobs:
            if job.status == "pending":
                job.status = "not run"
        failed = [j for j in jobs if j.status == "failed"]
        sweep.status = "interrupted" if interrupted else "failed" if failed else "finished"
        sweep.write(where)
    echo(summary(sweep, where))
    return 130 if interrupted else 1 if failed else 0


def _run_job(job: Job, cfg, train, pool: ClusterPool, tags: dict, with_cluster) -> int:
    """Run one job in this process through `with_cluster` and `train`; fills the job's record. A failure (an exit
    code other than 0 and 130, or an exception) is the job's status `failed` with its one line; returns the code."""
    record: dict = {}
    err = _LastError(sys.stderr)
    t0 = time.perf_counter()
    sys.stderr = err
    try:
        rc = with_cluster(cfg, lambda handle: train(cfg, handle, tags=tags, record=record), start=pool.start)
        reason = err.line
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one job's failure does not stop the sweep; its line is kept
        rc, reason = 1, f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(reason, file=err.stream)
    finally:
        sys.stderr = err.stream
        job.wall_s = round(time.perf_counter() - t0, 1)
        job.run_id, job.run_dir = record.get("run_id"), record.get("run_dir")
        job.mlflow_run_id = record.get("mlflow_run_id")
    pool.after_job(job.run_id, rc == 0)
    job.exit_code = rc
    job.status = "finished" if rc == 0 else "interrupted" if rc == 130 else "failed"
    job.reason = None if rc == 0 else (reason or f"exit code {rc}")
    return rc


def summary(sweep: Sweep, where: Path) -> str:
    """The end-of-sweep lines: one per job (status, run id, wall time, a failed job's reason) and the report's
    command."""
    n_ok = sum(j.status == "finished" for j in sweep.jobs)
    lines = [f"dagrl: sweep {sweep.sweep_id} {sweep.status}: {n_ok} of {len(sweep.jobs)} job(s) finished | {where}"]
    for j in sweep.jobs:
        wall = f", {j.wall_s:.0f} s" if j.wall_s is not None else ""
        run = f" run {j.run_id}" if j.run_id else ""
        why = f": {j.reason}" if j.reason and j.status != "finished" else ""
        lines.append(f"  job {j.index} {j.label()}: {j.status}{run}{wall}{why}")
    root = "" if Path(sweep.run_root) == Path("runs").resolve() else f" --run-root {sweep.run_root}"
    lines.append(f"dagrl: report: python -m pipelines.compare --sweep {sweep.sweep_id}{root}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.sweep`: no command of its own; one line naming the two that are (exit 2; `--help`: this
    module's docstring, exit 0)."""
    from pipelines.cli import start
    if start(argv, __doc__) is None:
        return 0
    print("error: a sweep runs with `python -m pipelines.run -m KEY=A,B ...`; its report is `python -m "
          "pipelines.compare --sweep ID [--threshold X] [--run-root DIR]`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    from pipelines.cli import entry
    sys.exit(entry(main))
