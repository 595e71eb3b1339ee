"""The per-run performance report: where a run's time went, its throughput, its memory, its retries.

The Runner's `PerfRecorder` appends events to `<run dir>/perf/events.jsonl` while the run goes (a step, an eval, a
checkpoint, a retry, a rollback, a memory sample, the start and end of each driver session); `summarize(events)`
turns them into the `perf_summary.json` the Runner writes into the run dir and logs to MLflow at the end of a run,
and `format_table(summary)` is the table it prints. `python -m pipelines.perf RUN` does the same on demand (a run
still going, or one that ended without its summary).

Sources (nothing is timed by hand where Dask or torch measures):
- Dask's task stream (the scheduler's TaskStreamPlugin: every finished task's compute and transfer start/stop on
  its worker), read through its index cursor after each step, eval and checkpoint;
- the tasks' own timers for what one task does inside: a colocated `env_step` node's inference and replica
  weight-load seconds (tasks.rollout Meta.TIMING / Meta.WEIGHT_SYNC, per shard in step_metrics' `timing`), the
  slowest shard's rollout (`time/rollout_total_max`) and the update (`time/update`);
- the driver's wall of each training step (`time/step`: first submission to results fetched), eval (`time/eval`)
  and checkpoint, and of each session (`Runner.run`);
- the kernel's high-water resident set size of every process (getrusage ru_maxrss: the driver, which holds the
  embedded scheduler, an external scheduler, every worker at the end of each session) and torch's peak CUDA
  allocation on workers using CUDA; after each step the workers' heartbeat memory (Dask's `WorkerState.memory`),
  which keeps a (lower-bound) peak of workers lost before the end.

Definitions (seconds unless stated):
- phase of a task: by its key's name (the part before the first '-', pipelines.graphs): `PHASE_RULES`. A colocated
  env_step node runs inference and the replica's weight load inside: its Dask-measured compute is split between
  rollout, inference and weight_sync in the proportions of its shard's own timers. With disaggregated inference
  the shard's replica-load seconds (capped at the path's inference) move from inference to weight_sync.
- critical path of a step: the chain of the step graph's tasks, along their dependencies, with the largest sum of
  task seconds (compute + transfer of the task's inputs to its worker, `transfer`). Per step, `path[phase]` is
  that chain's seconds per phase.
- scheduling overhead of a step = step wall - critical path: the scheduler's and the driver's share (submission,
  queueing, task dispatch, result fetch). With synchronous steps each task of the chain starts after its
  dependency stopped, so 0 <= path <= wall and the phases plus the overhead add up to the step wall. With
  `runner.max_staleness` > 0 a step's tasks can run while the driver still waits for the previous step: the path
  can exceed the wall; the overhead is then 0 and the excess is reported as `overlap_s`.
- busy seconds of a phase: its tasks' compute (and transfer) summed over every task and worker (worker-seconds;
  can exceed the wall when tasks run in parallel). Tasks of attempts given up (a lost worker) count as `retried`.
- run wall: the sum over driver sessions (a resume is a new session) of `Runner.run`'s wall. The summary's
  `phases` partition it: the steps' path phases and scheduling overhead, `init` (the wait for the init graph's
  weights at the start of a session), `eval`, `checkpoint` (driver walls of those graphs) and `driver` (the rest:
  the MLflow logging, the memory samples, the progress bar).
- env steps/s = env steps / rollout seconds (the sum over steps of `time/rollout_total_max`: the slowest shard's
  rollout, inference included when colocated); env steps/s (wall) = env steps / the sum of the step walls.
- update samples/s = sum over steps of (samples x epochs run) / the sum of `time/update`; samples =
  env.num_envs x rollout.chunk_steps (one per env and chunk step, the update's flattened batch); an SFT step's
  samples = its minibatch updates (`train/minibatch_updates`) x sft.batch_size, one epoch.
- peak memory of a process: its high-water RSS (GiB); of a role: the sum over its processes (an upper bound of their
  simultaneous peak); of the cluster: the sum over every process seen (driver, scheduler, workers, workers since
  lost), the figure the run's last line prints. Nannies are not counted.
Every step that ran counts, also one redone after a rollback (its time was spent); `steps` counts them all.
"""
from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from graphlib import TopologicalSorter
from pathlib import Path

from tasks.profiling import process_memory, scheduler_memory

EVENTS = "perf/events.jsonl"
SUMMARY = "perf_summary.json"
SCHEMA = 1

# phase of a task, from the name of its key (fullmatch, first rule that matches; else "other_tasks")
PHASE_RULES: tuple[tuple[str, str], ...] = (
    (r"env_step_s\d+(p\d+)?|env_observe_s\d+(p\d+)?|trajectory_s\d+", "rollout"),
    (r"policy_infer(_p\d+)?", "inference"),
    (r"weights_handle|update_handle", "weight_sync"),
    (r"store_s\d+", "store"),
    (r"advantages_s\d+", "advantages"),
    (r"actor_update(_r\d+)?|sft_update", "update"),
    (r"(eval|val)_s\d+|weights_handle_(eval|val)|eval_videos", "eval"),  # the validation split's too
    (r"actor_state(_r\d+)?|checkpoint|export_pretrained", "checkpoint"),
    (r"env_spec|load_checkpoint|actor_init|weights|free_port", "init"),
)
STEP_PHASES = ("rollout", "inference", "weight_sync", "transfer", "store", "advantages", "update", "other_tasks")
RUN_PHASES = (*STEP_PHASES, "scheduling_overhead", "init", "eval", "checkpoint", "driver")
_RULES = [(re.compile(p), ph) for p, ph in PHASE_RULES]
_SHARD = re.compile(r"env_step_s(\d+)")


def phase_of(key: str) -> str:
    """The phase (`PHASE_RULES`) of a task key `name-tag...`."""
    name = str(key).split("-", 1)[0]
    for rx, ph in _RULES:
        if rx.fullmatch(name):
            return ph
    return "other_tasks"


def task_seconds(record: dict) -> tuple[float, float]:
    """(compute, transfer) seconds of one task-stream record: its "compute" start/stops, and every other action
    (input transfers, spill reads/writes) as transfer."""
    comp = xfer = 0.0
    for ss in record.get("startstops", ()):
        d = float(ss["stop"]) - float(ss["start"])
        if ss.get("action") == "compute":
            comp += d
        else:
            xfer += d
    return comp, xfer


def critical_path(deps: dict[str, set], seconds: dict[str, float]) -> list[str]:
    """The chain through `deps` (key -> the keys it depends on; keys outside `deps` are ignored) with the largest
    sum of `seconds` (a key without an entry weighs 0), first key first. Ties: the first dependency listed."""
    best: dict[str, float] = {}
    prev: dict[str, str | None] = {}
    for k in TopologicalSorter({k: {d for d in v if d in deps} for k, v in deps.items()}).static_order():
        ds = [d for d in deps[k] if d in deps]
        p = max(ds, key=lambda d: best[d], default=None)
        best[k] = seconds.get(k, 0.0) + (best[p] if p is not None else 0.0)
        prev[k] = p
    if not best:
        return []
    k: str | None = max(best, key=best.get)
    out = []
    while k is not None:
        out.append(k)
        k = prev[k]
    return out[::-1]


def split_phases(keys, times: dict[str, tuple[float, float]], timing: list[dict] | None, colocated: bool) -> dict:
    """Seconds per phase of the tasks `keys` (`times`: key -> (compute, transfer)). Colocated env_step nodes are
    split with their shard's own timers (`timing[s]`: {"infer", "total", "weight_sync"}); with disaggregated
    inference the replica-load seconds (the largest shard's) move from inference to weight_sync."""
    out: dict[str, float] = defaultdict(float)
    for k in keys:
        comp, xfer = times.get(k, (0.0, 0.0))
        out["transfer"] += xfer
        ph = phase_of(k)
        m = _SHARD.match(str(k))
        if colocated and m and timing and int(m.group(1)) < len(timing):
            t = timing[int(m.group(1))]
            total = float(t.get("total") or 0.0)
            if total > 0:
                inf = comp * min(1.0, float(t.get("infer", 0.0)) / total)
                sync = min(comp - inf, comp * float(t.get("weight_sync", 0.0)) / total)
                out["inference"] += inf
                out["weight_sync"] += sync
                out["rollout"] += comp - inf - sync
                continue
        out[ph] += comp
    if not colocated and timing and out.get("inference", 0.0) > 0:
        sync = min(out["inference"], max(float(t.get("weight_sync", 0.0)) for t in timing))
        out["inference"] -= sync
        out["weight_sync"] += sync
    return dict(out)


def read_events(run_dir: str | Path) -> list[dict]:
    """The perf events of a run dir (oldest first; [] when none were written). A torn last line (a driver killed
    while writing) is skipped."""
    path = Path(run_dir) / EVENTS
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class PerfRecorder:
    """Collects a run's perf events on the driver (see the module docstring). Never fails the run: a task stream
    or memory read that errors or takes over `timeout_s` is skipped (and counted in `perf_read_errors`)."""

    def __init__(self, client, run_dir: Path, run_id: str, *, roles, colocated: bool, samples_per_step: int,
                 timeout_s: float = 10.0, sft_batch_size: int = 0):
        """roles: () -> {worker address: role} of the current placement ("env_workers", "gpu_workers");
        samples_per_step: the update's samples per training step (env.num_envs x rollout.chunk_steps);
        sft_batch_size: an SFT step's samples per minibatch update (sft.batch_size)."""
        self.client, self.run_dir, self.run_id = client, Path(run_dir), run_id
        self.roles, self.colocated, self.samples_per_step = roles, colocated, samples_per_step
        self.sft_batch_size = sft_batch_size
        self.timeout_s = timeout_s
        self.errors: list[str] = []  # the perf reads skipped (failed or over timeout_s), one line each
        self._times: dict[str, tuple[float, float]] = {}  # key -> (compute, transfer) not yet accounted
        self._cursor = self._call(lambda: self.client.sync(self.client.scheduler.get_task_stream_index), 0,
                                  "the task stream's index")
        self._tag = re.compile(re.escape(run_id) + r"-(\d+)")
        self._accounted_step = -1  # graphs of steps <= this (0-based index) are accounted
        self._procs: dict[str, dict] = {}  # "driver" | "scheduler" | worker address -> its largest memory, role
        self._t0: float | None = None

    # ----- plumbing -----
    def _call(self, fn, default, what: str = "a perf read"):
        from pipelines.bounded import bounded
        from pipelines.runner.watcher import one_line
        try:
            return bounded(fn, timeout=self.timeout_s, what=what)
        except Exception as exc:  # noqa: BLE001 - the report is best effort, the run is not
            self.errors.append(f"{what}: {type(exc).__name__}: {one_line(exc)}")
            return default

    def _write(self, event: dict) -> None:
        from storage.rundir import make_dir_in
        path = self.run_dir / EVENTS
        make_dir_in(self.run_dir, *path.parent.relative_to(self.run_dir).parts)  # never the run dir itself
        with path.open("a") as f:
            f.write(json.dumps({**event, "t": time.time()}) + "\n")

    def poll(self) -> None:
        """Read the task-stream records since the last poll into the pending task times."""
        recs = self._call(lambda: self.client.sync(self.client.scheduler.get_task_stream,
                                                   start_index=self._cursor), None, "the task stream")
        if recs is None:
            return
        self._cursor += len(recs)
        for r in recs:
            key = str(r["key"])
            if self.run_id in key:  # a shared cluster runs other runs' tasks too
                self._times[key] = task_seconds(r)

    def _take(self, keys) -> dict[str, tuple[float, float]]:
        return {k: self._times.pop(k) for k in keys if k in self._times}

    def _other_busy(self, phases: tuple[str, ...]) -> dict:
        """Busy seconds of the pending tasks of `phases`, and of step tasks of given-up attempts (as `retried`);
        removes them from the pending tasks."""
        busy: dict[str, float] = defaultdict(float)
        for k in list(self._times):
            ph = phase_of(k)
            m = self._tag.search(k)
            stale = ph not in ("eval", "checkpoint", "init") and m is not None \
                and int(m.group(1)) <= self._accounted_step
            if ph in phases or stale:
                comp, xfer = self._times.pop(k)
                busy["retried" if stale else ph] += comp + xfer
        return dict(busy)

    # ----- events -----
    def session_start(self) -> None:
        """A driver session (Runner.run) starts."""
        self._t0 = time.perf_counter()
        self._write({"kind": "session"})

    def step(self, step: int, graph, out: dict, m: dict, *, env_steps: int, attempt: int) -> dict:
        """Account training step `step` (1-based, as MLflow's) whose graph was `graph` (a HighLevelGraph: its
        layers' dependencies are the tasks'), `out` its step_metrics output, `m` its metrics (time/step,
        time/rollout_total_max, time/update, train/epochs_run), `env_steps` its env steps and `attempt` the
        retry that finished it (0: the first). Returns the step's event."""
        self.poll()
        deps = {str(k): {str(d) for d in v} for k, v in graph.dependencies.items()}
        times = self._take(deps)
        path = critical_path(deps, {k: c + x for k, (c, x) in times.items()})
        timing = out.get("timing") if isinstance(out, dict) else None
        on_path = split_phases(path, times, timing, self.colocated)
        busy = split_phases(times, times, timing, self.colocated)
        wall = float(m.get("time/step", 0.0))
        path_s = sum(on_path.values())
        ev = {"kind": "step", "step": step, "attempt": int(attempt), "wall_s": wall,
              "path": on_path, "busy": busy, "overhead_s": max(0.0, wall - path_s),
              "overlap_s": max(0.0, path_s - wall), "env_steps": int(env_steps),
              "rollout_s": float(m.get("time/rollout_total_max", 0.0)), "update_s": float(m.get("time/update", 0.0)),
              "samples": (self.samples_per_step if "time/rollout_total_max" in m  # SFT: its minibatches
                          else int(m.get("train/minibatch_updates", 0)) * self.sft_batch_size),
              "epochs": float(m.get("train/epochs_run", 1.0)), "tasks": len(times)}
        self._accounted_step = step - 1
        ev["busy_other"] = self._other_busy(("init",))
        self._write(ev)
        return ev

    def phase(self, kind: str, step: int, wall_s: float) -> None:
        """The actor's init, an eval or a checkpoint (`kind`: init | eval | checkpoint) at step `step` took
        `wall_s` on the driver."""
        self.poll()
        self._write({"kind": kind, "step": step, "wall_s": float(wall_s),
                     "busy_other": self._other_busy(("eval", "checkpoint", "init"))})

    def retry(self, what: str, step: int) -> None:
        """A graph (`what`: "training step", "evaluation", ...) for step `step` is retried after a loss."""
        self._write({"kind": "retry", "what": what, "step": step})

    def rollback(self, to_step: int) -> None:
        self._write({"kind": "rollback", "to_step": to_step})

    def sample_memory(self, exact: bool = False) -> int:
        """Read every process's memory, keep each one's largest and log a memory event when a peak rose; returns
        the resident bytes of the driver and every worker now (the driver's alone if the scheduler does not answer).

        Each call: the driver's own high-water RSS, and one scheduler query for the scheduler's and, from the
        workers' heartbeats, every worker's current RSS (a lower bound of its peak, kept for workers lost later).
        `exact` (the end of a session): also each worker's kernel high-water RSS and torch's peak CUDA
        allocation (`client.run`, which waits for a worker's event loop, so not after every step)."""
        roles = self.roles()
        me = process_memory()
        seen = {"driver": ("driver", me)}  # process -> (role, memory); workers by address (a restart: a new one)
        sched = self._call(lambda: self.client.run_on_scheduler(scheduler_memory), None, "the scheduler's memory")
        now = me["rss"]
        if sched is not None:
            if (sched["host"], sched["pid"]) != (me["host"], me["pid"]):  # not the embedded one (the driver's)
                seen["scheduler"] = ("scheduler", sched)
                now += sched["rss"]
            for addr, w in sched["workers"].items():
                seen[addr] = (roles.get(addr, "other_workers"), {"peak_rss": w["rss"], "gpu_peak": None})
                now += w["rss"]
        if exact:
            got = self._call(lambda: self.client.run(process_memory, on_error="return"), {}, "the workers' memory")
            for addr, mem in (got or {}).items():
                if isinstance(mem, dict):
                    seen[addr] = (roles.get(addr, "other_workers"), mem)
        rose = False
        for pid, (role, mem) in seen.items():
            old = self._procs.get(pid, {"peak_rss": 0, "gpu_peak": None})
            peak, gpu = max(mem["peak_rss"], old["peak_rss"]), max(mem.get("gpu_peak") or 0, old["gpu_peak"] or 0)
            if pid not in self._procs or peak > old["peak_rss"] or gpu > (old["gpu_peak"] or 0):
                rose = True
                self._procs[pid] = {"role": role, "peak_rss": peak, "gpu_peak": gpu or None}
        if rose:
            self._write({"kind": "memory", "procs": self._procs})
        return now

    def cluster_peak_bytes(self) -> int:
        """The sum over every process seen of its peak RSS (bytes; 0 before the first sample)."""
        return sum(p["peak_rss"] for p in self._procs.values())

    def session_end(self, read_cluster: bool = True) -> None:
        """The driver session ends (its wall: since `session_start`); `read_cluster`: poll the task stream a last
        time (not when the run failed: the cluster may be gone)."""
        if read_cluster:
            self.poll()
        self._write({"kind": "session_end", "wall_s": time.perf_counter() - self._t0 if self._t0 else 0.0,
                     "busy_other": self._other_busy(("eval", "checkpoint", "init")),
                     "perf_read_errors": self.errors[:20]})


# ----- the summary -----
def summarize(events: list[dict]) -> dict:
    """`perf_summary.json` from a run's events (module docstring: the definitions). A session without its end event
    (a run still going, or killed) counts up to its last event."""
    wall = 0.0
    start = last_t = None
    for ev in events:
        if ev["kind"] == "session":
            if start is not None:  # the previous session ended without its end event
                wall += last_t - start
            start = ev["t"]
        elif ev["kind"] == "session_end":
            wall += ev["wall_s"]
            start = None
        last_t = ev.get("t", last_t)
    if start is not None:
        wall += last_t - start
    steps = [e for e in events if e["kind"] == "step"]
    path = {ph: sum(e["path"].get(ph, 0.0) for e in steps) for ph in STEP_PHASES}
    busy: dict[str, float] = defaultdict(float)
    for e in events:
        for src in ("busy", "busy_other"):
            for ph, s in e.get(src, {}).items():
                busy[ph] += s
    phases = {**path, "scheduling_overhead": sum(e["overhead_s"] for e in steps),
              "init": sum(e["wall_s"] for e in events if e["kind"] == "init"),
              "eval": sum(e["wall_s"] for e in events if e["kind"] == "eval"),
              "checkpoint": sum(e["wall_s"] for e in events if e["kind"] == "checkpoint")}
    phases["driver"] = max(0.0, wall - sum(phases.values()))
    env_steps = sum(e["env_steps"] for e in steps)
    rollout_s = sum(e["rollout_s"] for e in steps)
    step_wall = sum(e["wall_s"] for e in steps)
    update_s = sum(e["update_s"] for e in steps)
    samples = sum(e["samples"] * e["epochs"] for e in steps)
    mem = next((e["procs"] for e in reversed(events) if e["kind"] == "memory"), {})
    roles: dict[str, dict] = {}
    for p in mem.values():
        r = roles.setdefault(p["role"], {"processes": 0, "peak_rss_gib": 0.0, "peak_rss_max_gib": 0.0,
                                         "gpu_peak_gib": None})
        r["processes"] += 1
        r["peak_rss_gib"] += p["peak_rss"] / 2**30
        r["peak_rss_max_gib"] = max(r["peak_rss_max_gib"], p["peak_rss"] / 2**30)
        if p.get("gpu_peak"):
            r["gpu_peak_gib"] = max(r["gpu_peak_gib"] or 0.0, p["gpu_peak"] / 2**30)
    retries = [e for e in events if e["kind"] == "retry"]
    return {
        "schema": SCHEMA,
        "wall_s": wall,
        "sessions": sum(1 for e in events if e["kind"] == "session"),
        "steps": len(steps),
        "phases_s": phases,
        "phases_share": {k: (v / wall if wall > 0 else 0.0) for k, v in phases.items()},
        "busy_s": dict(busy),
        "step_wall_s": step_wall,
        "overlap_s": sum(e["overlap_s"] for e in steps),
        "env_steps": env_steps,
        "rollout_s": rollout_s,
        "env_steps_per_s": env_steps / rollout_s if rollout_s > 0 else None,
        "env_steps_per_s_wall": env_steps / step_wall if step_wall > 0 else None,
        "update_samples": samples,
        "update_s": update_s,
        "update_samples_per_s": samples / update_s if update_s > 0 else None,
        "memory": {"roles": roles, "cluster_peak_rss_gib": sum(p["peak_rss"] for p in mem.values()) / 2**30},
        "retries": {"total": len(retries),
                    "by_graph": {w: sum(1 for e in retries if e["what"] == w) for w in {e["what"] for e in retries}},
                    "rollbacks": sum(1 for e in events if e["kind"] == "rollback"),
                    "steps_retried": sum(1 for e in steps if e["attempt"] > 0)},
        "perf_read_errors": [x for e in events if e["kind"] == "session_end"
                             for x in (e.get("perf_read_errors") or [])],
        "evals": sum(1 for e in events if e["kind"] == "eval"),
        "checkpoints": sum(1 for e in events if e["kind"] == "checkpoint"),
    }


def format_table(s: dict) -> str:
    """The summary as the table the run prints (seconds, shares of the run wall, GiB). Its first line says what it
    counts: the whole run, every driver session of it (`perf, whole run (2 sessions): 26 step(s) in 185.8 s of run
    wall, the sessions' walls summed`; a resumed run's done line counts its own session). A run with no env steps
    (SFT: its samples come from a store) has no env steps/s, only the update's samples/s."""
    def num(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)
    n = s["sessions"]
    lines = [f"perf, whole run ({n} session{'' if n == 1 else 's'}): {s['steps']} step(s) in {s['wall_s']:.1f} s of "
             f"run wall" + (", the sessions' walls summed" if n > 1 else ""),
             f"  {'phase':<20}{'wall s':>9}{'share':>8}{'busy s':>9}"]
    for ph in RUN_PHASES:
        v = s["phases_s"].get(ph, 0.0)
        b = s["busy_s"].get(ph)
        lines.append(f"  {ph:<20}{v:>9.2f}{100 * s['phases_share'].get(ph, 0.0):>7.1f}%{num(b, '{:.2f}'):>9}")
    if s["busy_s"].get("retried"):
        lines.append(f"  {'(retried attempts)':<20}{'':>9}{'':>8}{s['busy_s']['retried']:>9.2f}")
    env = (f"env steps/s {num(s['env_steps_per_s'], '{:.0f}')} (rollout), "
           f"{num(s['env_steps_per_s_wall'], '{:.0f}')} (step wall) | " if s["env_steps"] else "")
    lines.append(f"  {env}update samples/s {num(s['update_samples_per_s'], '{:.0f}')}")
    mem = s["memory"]
    roles = ", ".join(f"{r} {v['peak_rss_gib']:.2f}" + (f" ({v['processes']})" if v["processes"] > 1 else "")
                      + (f" [GPU {v['gpu_peak_gib']:.2f}]" if v.get("gpu_peak_gib") else "")
                      for r, v in sorted(mem["roles"].items()))
    lines.append(f"  peak memory GiB: cluster {mem['cluster_peak_rss_gib']:.2f} = {roles or 'not sampled'}")
    r = s["retries"]
    lines.append(f"  retries {r['total']} ({', '.join(f'{k} {v}' for k, v in sorted(r['by_graph'].items())) or 'none'})"
                 f", rollbacks {r['rollbacks']}, evals {s['evals']}, checkpoints {s['checkpoints']}")
    return "\n".join(lines)


def write_summary(run_dir: str | Path) -> tuple[Path, dict]:
    """Summarize the run dir's events and write `<run dir>/perf_summary.json`; returns (its path, the summary)."""
    s = summarize(read_events(run_dir))
    from storage.rundir import write_text_atomic
    return write_text_atomic(Path(run_dir) / SUMMARY, json.dumps(s, indent=1, sort_keys=True)), s
