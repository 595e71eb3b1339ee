"""A sweep's jobs side by side on an existing cluster: `python -m pipelines.run -m --jobs N KEY=A,B ...`.

Asked for with `--jobs N` (`-j N`, `--jobs=N`; N >= 1: at most N jobs at once) next to `-m`. Only on an existing
cluster (`cluster=address cluster.address=tcp://HOST:PORT`, every job the same address): the embedded cluster
(`cluster.kind=local`) and the batch kinds start their own workers per driver, so there a sweep keeps running its
jobs one after another (`pipelines.sweep`), and `--jobs` is refused in one line naming the fix.

Slots (`plan_slots`): N slots. The driver connects to the scheduler once and counts its GPU workers (resource
`GPU`; logical ones on a CPU-only cluster count the same). Where at least two devices can each hold a whole job
(`pins`: the job leaves `cluster.component_placement` at its default and has one actor rank; the device's pinned
placement passes `pipelines.clusters.plan_placement` on the live workers), slot i is pinned to device i mod D: its
job gets `cluster.component_placement={actor:d,rollout:d,env:d}`, so it uses GPU worker d and only the env workers
that serve device d; more slots than devices put two jobs on one device (on real GPUs, `--jobs` at most the GPU
workers keeps one job a device). Otherwise (one GPU worker, or jobs that place themselves) the N slots share the
workers, each job placed by its own config: their tasks interleave on the same workers. Before a job starts in a
slot, its config with the slot's placement is checked with `plan_placement` again (a job it refuses fails with
that line, nothing started); a job waits for a free slot.

Each job is its own driver process, `python -c CHILD JOB_FILE` (`pipelines.run.sweep_job_main`: pipelines.run's
training path with the job's overrides, the slot's placement and the sweep's MLflow tags, `job_tags`), started in
its own session with stdout and stderr to `<sweep dir>/job-<i>.log`; the sweep's console shows one line per job
start and end. `sweep.json` is rewritten (by this process only) as each job ends: status, exit code, run id, wall
time and, for a job that did not finish, the last `error: ...` / `interrupted ...` line of its log. A failed job
does not stop the others. Ctrl-C (SIGINT) or SIGTERM: the same signal goes to every running job (each stops as one
run does: the step in flight, a checkpoint, exit 130), no further job starts, the pending ones are marked `not run`;
a second one is passed on too (the jobs exit at once). A sweep started with SIGINT ignored (a script's background
job) keeps ignoring it, as a run does (`pipelines.cli.signal_handlers`); SIGTERM still stops it. Exit codes as for
the sweep one after another: 0 every job finished, 1 one failed, 2 refused before anything ran, 130 interrupted.

Two drivers on one cluster do not clash: Dask keys carry the run id (`pipelines.graphs._step_tag`), the
worker-resident objects are keyed `<run_id>/...` (tasks.rollout, tasks.actor; the `dims/...` cache holds the same
value for the same env config) and the registry's plugin is registered only when the scheduler has none
(`tasks.resident.install`, idempotent: a second driver no longer replaces it and with it the first one's objects),
each run has its own run dir, run lock and MLflow run (the store's first use and an experiment created by two at
once are handled by storage.tracking). After each job this driver releases that run's resident objects
(`<run_id>/`). What is shared: the workers' CPU and memory, and a recovery in one job that restarts a stuck worker
costs the other jobs on it a retried step.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipelines.cli import UsageError

CHILD = "import sys; from pipelines.run import sweep_job_entry; sys.exit(sweep_job_entry())"  # a job's process
POLL_S = 0.2  # how often the driver looks at its jobs' processes
DEFAULT_PLACEMENT = ("", None)  # a component_placement entry left to the kind's default


def jobs_flag(argv: list[str]) -> tuple[list[str], int | None]:
    """(the words without `--jobs N` / `--jobs=N` / `-j N` / `-jN`, N or None when not given).

    Raises:
        UsageError: a value that is not a whole number >= 1, or the flag without its value."""
    out, n, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        value = None
        if a in ("--jobs", "-j"):
            if i + 1 >= len(argv):
                raise UsageError(f"{a} takes a number of jobs at once, e.g. -m {a} 2 seed=1,2,3")
            value, i = argv[i + 1], i + 2
        elif a.startswith("--jobs="):
            value, i = a.partition("=")[2], i + 1
        elif a.startswith("-j") and a[2:].isdigit():
            value, i = a[2:], i + 1
        else:
            out.append(a)
            i += 1
            continue
        if not value.isdigit() or int(value) < 1:
            raise UsageError(f"--jobs {value!r}: a whole number of jobs at once, at least 1 (e.g. -m --jobs 2 "
                             f"seed=1,2,3)")
        n = int(value)
    return out, n


def refusal(cfgs: list, n: int) -> str | None:
    """The one line that refuses `--jobs n` for these jobs' configs, or None when they may run side by side: every
    job on an existing cluster (`cluster.kind=address`) at one address."""
    kinds = sorted({c.cluster.kind for c in cfgs})
    if kinds != ["address"]:
        return (f"error: --jobs {n}: jobs side by side need an existing cluster (cluster=address "
                f"cluster.address=tcp://HOST:PORT); cluster.kind={'/'.join(kinds)} starts its own workers per "
                f"driver, so its sweep runs the jobs one after another: leave out --jobs, or start a cluster "
                f"(docs/guides/sweeps.md)")
    addresses = sorted({str(c.cluster.address) for c in cfgs})
    if len(addresses) > 1:
        return (f"error: --jobs {n}: the jobs name {len(addresses)} cluster.address values ({', '.join(addresses)});"
                f" side by side shares one existing cluster: give one address, or leave out --jobs")
    return None


def placement_override(device: int) -> str:
    """The override that puts every component of a job on `device`."""
    return f"cluster.component_placement={{actor:{device},rollout:{device},env:{device}}}"


def pins(cfg) -> bool:
    """Whether a job can be pinned to one device: its `cluster.component_placement` left at the default (every
    component "") and one actor rank."""
    cp = dict(cfg.cluster.component_placement or {})
    return all(v in DEFAULT_PLACEMENT for v in cp.values()) and cfg.algorithm.num_actor_ranks == 1


@dataclass(frozen=True)
class Slot:
    """One place a job runs in: its `index` and the `device` its jobs are pinned to (None: the job's own
    placement, the workers shared with the other slots)."""

    index: int
    device: int | None

    def describe(self) -> str:
        return f"slot {self.index}, " + (f"device {self.device}" if self.device is not None else "shared workers")


def gpu_workers(info: dict, cfg) -> int:
    """The GPU workers (resource GPU >= 1) of a scheduler's `info` (`cluster_info`), at most `cluster.num_gpus`."""
    n = sum(1 for w in info["workers"].values() if w.get("resources", {}).get("GPU", 0) >= 1)
    return min(n, cfg.cluster.num_gpus) if cfg.cluster.num_gpus is not None else n


def plan_slots(n: int, devices: list[int]) -> list[Slot]:
    """`n` slots: pinned round-robin over `devices` (the devices a pinned job fits on) when there are at least two,
    else all sharing the workers (device None)."""
    if len(devices) < 2:
        return [Slot(i, None) for i in range(n)]
    return [Slot(i, devices[i % len(devices)]) for i in range(n)]


def slot_config(job, cfg, slot: Slot, info):
    """(the job's overrides in `slot`, its config) after `plan_placement` on the live workers `info`.

    Raises:
        ConfigError (PlacementError among them): the slot's placement, or the job's own, does not fit the workers."""
    from pipelines.clusters import plan_placement
    overrides = list(job.overrides)
    if slot.device is not None and pins(cfg):  # the job's process composes and checks it again (its log's notes)
        overrides.append(placement_override(slot.device))
        cfg = _pinned(cfg, slot.device)
    plan_placement(cfg, info)
    return overrides, cfg


def devices_that_fit(cfg, info) -> list[int]:
    """The devices of the cluster `info` that a job of `cfg` pinned there fits on (`plan_placement`); [] when the job
    does not pin (`pins`) or the cluster has fewer than two GPU workers."""
    from pipelines.clusters import plan_placement
    from tasks.config import ConfigError
    n = gpu_workers(info, cfg)
    if n < 2 or not pins(cfg):
        return []
    ok = []
    for dev in range(n):
        try:
            plan_placement(_pinned(cfg, dev), info)
        except ConfigError:
            continue
        ok.append(dev)
    return ok


def _pinned(cfg, device: int):
    """`cfg` with every component on `device` (what `placement_override` asks of Hydra)."""
    import dataclasses
    spec = {"actor": str(device), "rollout": str(device), "env": str(device)}
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, component_placement=spec))


def prepare(cfgs: list, n: int):
    """(a Client of the jobs' cluster, the slots, None) for `--jobs n`, or (None, None, the one line refusing it):
    not an existing cluster (`refusal`), or a scheduler that does not answer (exit 2, nothing run)."""
    line = refusal(cfgs, n)
    if line is not None:
        return None, None, line
    from pipelines.clusters import attach, cluster_info
    try:
        client = attach(cfgs[0])
    except (ConnectionError, ValueError) as exc:
        return None, None, f"error: {exc}"
    return client, plan_slots(n, devices_that_fit(cfgs[0], cluster_info(client))), None


class _Forward:
    """While active (main thread): SIGINT and SIGTERM are passed on to every running job's process (`pids()`), and
    counted; no KeyboardInterrupt here (the jobs stop themselves and this driver waits for them)."""

    def __init__(self, pids):
        self.pids, self.name, self.count, self.signum = pids, None, 0, signal.SIGINT

    def __enter__(self):
        self._old = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)
                     if not (s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN)}
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)

    def handler(self, signum, frame) -> None:
        self.name, self.count, self.signum = self.name or signal.Signals(signum).name, self.count + 1, signum
        self.forward(signum)
        again = "" if self.count > 1 else "; again to stop them at once, without one"
        print(f"dagrl: {signal.Signals(signum).name}: passed on to the running jobs (each stops after its step in "
              f"flight and writes a checkpoint{again}); no further job starts", file=sys.stderr, flush=True)

    def forward(self, signum) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


@dataclass
class _Running:
    job: object
    slot: Slot
    proc: subprocess.Popen
    log: Path
    record: Path
    t0: float


def _child_env() -> dict:
    """The job processes' environment: this one, with dagrl's source root first on PYTHONPATH."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def _start(sweep, where: Path, job, overrides: list[str], slot: Slot, job_tags) -> _Running:
    """Start job `job`'s driver process with `overrides` (its slot's placement included); `job_tags(sweep_id, job)`
    its MLflow tags (pipelines.sweep.job_tags)."""
    spec, log, record = (where / f"job-{job.index}.json", where / f"job-{job.index}.log",
                         where / f"job-{job.index}.record.json")
    spec.write_text(json.dumps({"overrides": overrides, "tags": job_tags(sweep.sweep_id, job),
                                "record": str(record), "label": f"sweep {sweep.sweep_id} job {job.index}"}) + "\n")
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(spec)], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=_child_env())
    return _Running(job, slot, proc, log, record, time.perf_counter())


def last_reason(log: Path) -> str | None:
    """The last `error: ...` / `interrupted ...` line of a job's log (its one-line reason), or None."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    found = [ln.strip() for ln in lines if ln.strip().startswith(("error: ", "interrupted"))]
    return found[-1] if found else None


def _finish(r: _Running, rc: int) -> None:
    """Fill job `r.job`'s record from its process's exit code `rc`, its record file and its log."""
    job = r.job
    job.wall_s = round(time.perf_counter() - r.t0, 1)
    try:
        rec = json.loads(r.record.read_text())
    except (OSError, ValueError):
        rec = {}
    job.run_id, job.run_dir, job.mlflow_run_id = rec.get("run_id"), rec.get("run_dir"), rec.get("mlflow_run_id")
    if rc < 0:  # killed by a signal it did not handle
        rc = 128 - rc
    job.exit_code = rc
    job.status = "finished" if rc == 0 else "interrupted" if rc == 130 else "failed"
    job.reason = None if rc == 0 else (last_reason(r.log) or f"exit code {rc}")


def run_side_by_side(sweep, where: Path, cfgs: list, client, slots: list[Slot], *, job_tags, summary,
                     echo=print) -> int:
    """Run `sweep`'s jobs (their checked configs `cfgs`) in `slots` on `client`'s cluster, each in its own driver
    process (module docstring); `sweep.json` in `where` rewritten as each job starts and ends. Returns the exit
    code: 0 every job finished, 1 one failed, 130 interrupted. `job_tags(sweep_id, job)` and `summary(sweep, where)`
    are pipelines.sweep's (passed in: this module imports neither pipelines.sweep nor pipelines.run)."""
    from pipelines.clusters import cluster_info
    from tasks import resident
    from tasks.config import ConfigError
    total = len(sweep.jobs)
    pending = list(zip(sweep.jobs, cfgs))
    free = list(slots)
    running: dict[int, _Running] = {}
    sweep.extra = {**sweep.extra, "jobs_at_once": len(slots), "slots": [s.describe() for s in slots]}
    sweep.write(where)
    echo(f"dagrl: sweep {sweep.sweep_id}: up to {len(slots)} job(s) at once on {cfgs[0].cluster.address} ("
         f"{'; '.join(s.describe() for s in slots)}); each job's output: {where}/job-N.log", flush=True)
    stop = _Forward(lambda: [r.proc.pid for r in running.values()])
    try:
        with stop:
            while running or (pending and stop.name is None):
                while free and pending and stop.name is None:
                    job, cfg = pending.pop(0)
                    slot = free.pop(0)
                    job.experiment = cfg.experiment
                    try:
                        overrides, _ = slot_config(job, cfg, slot, cluster_info(client))
                    except ConfigError as exc:  # the slot's placement does not fit the live workers
                        job.status, job.exit_code, job.reason = "failed", 2, f"error: {exc}"
                        free.insert(0, slot)
                        sweep.write(where)
                        echo(f"dagrl: sweep {sweep.sweep_id} job {job.index + 1}/{total} failed before it started: "
                             f"{job.label()}: {job.reason}", flush=True)
                        continue
                    r = _start(sweep, where, job, overrides, slot, job_tags)
                    running[job.index] = r
                    job.status = "running"
                    sweep.write(where)
                    if stop.count:  # a signal that came while it started
                        stop.forward(stop.signum)
                    echo(f"dagrl: sweep {sweep.sweep_id} job {job.index + 1}/{total} started: {job.label()} "
                         f"({slot.describe()}) | log {r.log}", flush=True)
                for idx, r in list(running.items()):
                    rc = r.proc.poll()
                    if rc is None:
                        continue
                    del running[idx]
                    free.append(r.slot)
                    free.sort(key=lambda s: s.index)
                    _finish(r, rc)
                    if r.job.run_id:  # its worker-resident objects (safe beside the other jobs: keyed by run id)
                        try:
                            client.run(resident.release, f"{r.job.run_id}/", on_error="ignore")
                        except Exception:  # noqa: BLE001 - a busy or lost scheduler: the job's result stands
                            pass
                    sweep.write(where)
                    run = f" run {r.job.run_id}" if r.job.run_id else ""
                    why = f": {r.job.reason}" if r.job.reason else ""
                    echo(f"dagrl: sweep {sweep.sweep_id} job {r.job.index + 1}/{total} {r.job.status}: "
                         f"{r.job.label()}{run}, {r.job.wall_s:.0f} s{why}", flush=True)
                if running or (pending and stop.name is None):
                    time.sleep(POLL_S)
    finally:
        for r in running.values():  # only after an error of this driver: its jobs do not outlive it
            r.proc.terminate()
        for r in running.values():
            try:
                r.proc.wait(60)
            except subprocess.TimeoutExpired:
                r.proc.kill()
        interrupted = stop.name is not None
        for job in sweep.jobs:
            if job.status in ("pending", "running"):
                job.status = "not run" if job.status == "pending" else "interrupted"
        failed = [j for j in sweep.jobs if j.status == "failed"]
        sweep.status = "interrupted" if interrupted else "failed" if failed else "finished"
        sweep.write(where)
        client.close()
    echo(summary(sweep, where))
    return 130 if interrupted else 1 if failed else 0


class JobRecord(dict):
    """The run's record (`pipelines.run._train`'s `record`), written to `path` (JSON, atomically) on every update,
    so the sweep's driver finds the run id even of a job that ends badly."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)

    def update(self, *args, **kw) -> None:
        super().update(*args, **kw)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(self)) + "\n")
        os.replace(tmp, self.path)

