"""The watch over a run's placed workers (lost, paused, stuck, silent) and the recovery decision after a loss.

`Watcher` is the runner's collaborator for every wait on the cluster, and the whole watch of drivers without a
retry path (`pipelines.record`, `pipelines.eval`: `results`). It knows the config, the client, the placement and the
actor's rank count, nothing of the run: `wait_or_lost` / `fetch_or_lost` return the placed workers that left the
cluster, or that are alive but make no progress, within a bound; `results` raises `RunStalled` instead.

What counts as no progress (checked once a second while waiting, from the scheduler's view of each placed worker):

| worker state                                   | bound                                                   |
|------------------------------------------------|---------------------------------------------------------|
| `paused` (memory above its pause fraction)     | `runner.pause_timeout_s` without a break                 |
| a task executing far past its expected time    | max(`runner.stall_timeout_s`, 4 x the longest finished   |
| (blocked in a collective, a hung simulator)    | task of the same kind seen in this run)                 |
| not heard from (event loop blocked)            | `runner.stall_timeout_s`                                 |

A stall prints one line naming the worker, its state, its memory and the key to change. After a loss or a stall,
`plan_recovery` decides (restart the stuck, leave the paused out, re-place on the healthy workers: `RecoveryPlan`,
or `NoPlacement`); what the run does with it (retry, roll back, give up) is `pipelines.runner.recovery`'s.

Driver calls outside the watch that could block (`client.run`, `restart_workers`, `wait_for_workers`) carry a
bound (`bounded`, their own `timeout`).
"""
from __future__ import annotations

import re
import time
from asyncio import CancelledError
from contextlib import contextmanager
from dataclasses import dataclass

from pipelines.bounded import bounded
from pipelines.clusters import (PlacementError, cluster_info, pause_fraction, plan_placement, rejoin,
                                wait_for_workers, worker_health)
from tasks.config import ConfigError


class RunStalled(RuntimeError):
    """The run gave up (module docstring): one line `training step N: <what failed>; <what was saved>; <what to
    change>` (no `training step` prefix from a `Watcher`, which has no steps)."""


def one_line(exc: BaseException) -> str:
    """The first line of `exc`'s message, else its type's name (never empty, never a newline)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@dataclass
class Stall:
    """A placed worker that is alive but makes no progress.

    kind: "paused" (left out of the next placement) | "stuck" (a task far past its time) | "silent" (not heard
    from); the last two are restarted. line: the one-line description (worker, state, memory, what to change).
    """

    worker: str
    kind: str
    line: str


def _kind(key: str) -> str:
    """Task kind of a key: its name up to the first dash, digits dropped (`env_step_s1-run-3-0` -> `env_step_s`)."""
    return re.sub(r"\d+", "", str(key).split("-", 1)[0])


def _gib(n) -> str:
    return "unknown" if n is None else (f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB")


@dataclass
class RecoveryPlan:
    """`Watcher.plan_recovery`'s decision: the placement on the healthy workers, whether the actor's state was lost
    (the run rolls back), the workers left out (paused, or stuck and not restartable), whether stalls were seen."""

    placement: object
    actor_lost: bool
    paused: set
    stalled: bool


class NoPlacement(Exception):
    """No healthy placement after a loss (`plan_recovery`): the give-up line's parts, and `actor_healthy`."""

    def __init__(self, failed: str, fix: str, actor_healthy: bool):
        super().__init__(failed)
        self.failed, self.fix, self.actor_healthy = failed, fix, actor_healthy


class Watcher:
    """The watch over the placed workers (module docstring). `placement` is the current one (`replace_placement`
    after a recovery); `ranks`: the actor's rank count (its first `ranks` actor workers are watched)."""

    CALL_TIMEOUT_S = 120.0  # bound of one driver call to the workers outside the watch (client.run, restarts)

    def __init__(self, cfg, client, placement, *, ranks: int = 1, echo=print, placed_ids: dict | None = None):
        self.cfg, self.client, self.placement, self.ranks, self.echo = cfg, client, placement, ranks, echo
        self.only: set | None = None  # while writing the give-up checkpoint: the actor's workers (`narrowed`)
        self._names: dict[str, str] = {}
        self._watch = {"paused_since": {}, "executing": {}, "longest": {}, "stalls": {},
                       "t0": time.perf_counter()}  # made before the first watched wait (the init graph): ~ the start
        self._placed_ids = self._placed_worker_ids() if placed_ids is None else dict(placed_ids)

    def results(self, futures, what: str) -> list:
        """Results of `futures`, in order, for drivers without a retry path (pipelines.record, pipelines.eval).
        Raises RunStalled (`<what>: <failed>; nothing saved (no run); <fix>`): a placed worker lost or stalled."""
        futures = list(futures)
        self._start_watch()
        bad = self.wait_or_lost(futures)
        results = bad if bad else self.fetch_or_lost(futures)
        if isinstance(results, list):
            return results
        failed, fix = self.failure(results)
        raise RunStalled(f"{what}: {failed}; nothing saved (no run); {fix}")

    @property
    def started(self) -> float:  # perf_counter() when the watch was made (about the run's start)
        return self._watch["t0"]

    @contextmanager
    def narrowed(self, workers):
        """Watch only `workers` inside the block (the give-up checkpoint: a lost env worker does not stop it)."""
        self.only = set(workers)
        try:
            yield
        finally:
            self.only = None

    def replace_placement(self, placement) -> None:
        """Watch `placement` from now on (after a recovery): its workers' ids are recorded afresh."""
        self.placement = placement
        self._placed_ids = self._placed_worker_ids()

    # ----- the watch -----
    def _placed(self) -> set[str]:
        p = self.placement
        return set(self.only) if self.only else {*p.shard_workers, *p.actor_workers[:self.ranks], *p.rollout_workers}

    def _start_watch(self) -> None:
        """Called before each wait: forget the previous wait's stalls and pause clocks (kept: the longest task
        durations, the expected times)."""
        w = self._watch
        w["paused_since"], w["executing"], w["stalls"] = {}, {}, {}

    def _stalled_workers(self) -> dict[str, Stall]:
        """Placed workers alive but without progress beyond their bound (one scheduler query). Prints nothing."""
        r, w = self.cfg.runner, self._watch
        now = time.monotonic()
        health = worker_health(self.client, sorted(self._placed()))
        out: dict[str, Stall] = {}
        seen: dict[str, float] = {}
        for addr, h in health.items():
            for key, dur in h["executing"].items():
                seen[key] = dur
            if h["status"] == "paused":
                since = w["paused_since"].setdefault(addr, now)
                if now - since >= r.pause_timeout_s:
                    out[addr] = Stall(addr, "paused", self._paused_line(addr, h, now - since))
            else:
                w["paused_since"].pop(addr, None)
            if addr in out:
                continue
            for key, dur in h["executing"].items():
                limit = max(r.stall_timeout_s, 4.0 * w["longest"].get(_kind(key), 0.0))
                if dur > limit:
                    out[addr] = Stall(addr, "stuck", self._stuck_line(addr, h, key, dur, limit))
                    break
            else:
                if h["silent_s"] > r.stall_timeout_s:
                    out[addr] = Stall(addr, "silent", self._silent_line(addr, h))
        for key, dur in w["executing"].items():  # finished since the last look: their kind's expected time
            if key not in seen:
                w["longest"][_kind(key)] = max(w["longest"].get(_kind(key), 0.0), dur)
        w["executing"] = seen
        return out

    def _paused_line(self, addr: str, h: dict, paused_s: float) -> str:
        frac = pause_fraction(self.client, addr)
        frac_s = "unknown" if frac is None else f"{frac:g}"
        return (f"dagrl: worker {h['name']} ({addr}) paused for memory for {paused_s:.0f} s (runner.pause_timeout_s="
                f"{self.cfg.runner.pause_timeout_s:g}): process memory {_gib(h['memory'])} of its "
                f"{_gib(h['memory_limit'])} limit, pause fraction {frac_s}; raise cluster.memory_limit (now "
                f"{self.cfg.cluster.memory_limit}) or the pause fraction (distributed.worker.memory.pause, env "
                f"DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE, default 0.8)")

    def _stuck_line(self, addr: str, h: dict, key: str, dur: float, limit: float) -> str:
        return (f"dagrl: worker {h['name']} ({addr}) has been executing {key} for {dur:.0f} s, past its bound "
                f"{limit:.0f} s (runner.stall_timeout_s={self.cfg.runner.stall_timeout_s:g}, or 4x the longest "
                f"{_kind(key)}* task seen), status {h['status']}, process memory {_gib(h['memory'])} of "
                f"{_gib(h['memory_limit'])} (a rank blocked in a collective, a hung simulator); raise "
                f"runner.stall_timeout_s if such a task is legitimately this slow")

    def _silent_line(self, addr: str, h: dict) -> str:
        return (f"dagrl: worker {h['name']} ({addr}) not heard from for {h['silent_s']:.0f} s (runner.stall_timeout_s"
                f"={self.cfg.runner.stall_timeout_s:g}), status {h['status']}, last process memory "
                f"{_gib(h['memory'])} of {_gib(h['memory_limit'])}: its event loop is blocked")

    def _check(self) -> set[str]:
        """One look: lost placed workers, else stalled ones (recorded, their line printed once). Empty: all fine.

        Raises:
            ConnectionError: the client lost its scheduler for good (closed): `scheduler_info()` would keep
                answering from its last look (Scheduler._guarded turns this into the give-up line).
        """
        status = getattr(self.client, "status", "running")
        if status in ("closing", "closed", "failed"):
            raise ConnectionError(f"the client's connection to the scheduler is {status}")
        lost = self._lost_workers()
        if lost:
            return lost
        stalls = self._stalled_workers()
        if stalls:
            w = self._watch
            w["stalls"] = stalls
            self.echo("; ".join(s.line for s in stalls.values()))
            return set(stalls)
        return set()

    # ----- waiting -----
    def worker_ids(self) -> dict[str, str]:
        """address -> worker id (a restarted worker can come back on the same address with a new id and no state).
        Also remembers each address's worker name (`_name`: a lost worker is named after it is gone)."""
        workers = cluster_info(self.client)["workers"]
        self._names.update({a: w.get("name", a) for a, w in workers.items()})
        return {a: w.get("id", a) for a, w in workers.items()}

    def _placed_worker_ids(self, tries: int = 5) -> dict[str, str]:
        """`worker_ids()` once it lists every worker of the placement (up to `tries` looks 1 s apart): the ids the
        watch compares with later. A starved machine's scheduler_info() can list none of the live workers; recorded,
        such an answer made every placed worker look "restarted" at the next check (a spurious loss and rollback)."""
        placed = self._placed()
        ids = self.worker_ids()
        for _ in range(tries - 1):
            if placed <= set(ids):
                break
            time.sleep(1.0)
            ids = self.worker_ids()
        return ids

    def name(self, addr: str) -> str:
        return f"{self._names.get(addr, '?')} ({addr})"

    def worker_names(self, addrs) -> list[str]:
        """The worker names (`env-0`, `gpu-0`) of `addrs` as last seen, sorted; an address never seen is left out."""
        return sorted(str(self._names[a]) for a in addrs if a in self._names)

    def _lost_workers(self) -> set[str]:
        """Placed workers gone (or restarted with a new id), confirmed by a second look 2 s later: on a starved
        machine one scheduler_info() answer was seen to list none of the live workers (`cluster_info` asks the
        scheduler directly now; the second look stays). The placed workers: env, actor and rollout workers, or
        the narrowed set (`narrowed`)."""
        placed = self._placed()

        def missing() -> set[str]:
            now = self.worker_ids()
            return {a for a in placed if now.get(a) != self._placed_ids.get(a)}
        lost = missing()
        if lost:
            time.sleep(2.0)
            lost &= missing()
        return lost

    def wait_or_lost(self, futures) -> set[str]:
        """Wait for `futures`; return the placed worker addresses that left the cluster or stalled meanwhile
        (empty: done). Stalls are recorded for `plan_recovery` and printed (one line).

        A task pinned to a worker that died would wait forever in `no-worker`, and one pinned to a paused worker
        forever in `processing`, so the placed workers are checked every second while waiting. `distributed.wait`
        waits through the process's default client: this run's client is made the current one for it, so another
        client of the same process (a notebook's, a second cluster's) is never the one asked.
        """
        from distributed import wait
        self._start_watch()
        while True:
            try:
                with self.client.as_current():
                    wait(futures, timeout=1.0)
                return set()
            except TimeoutError:
                bad = self._check()
                if bad:
                    return bad

    def fetch_or_lost(self, futures) -> list | set[str]:
        """Results of finished futures, or the set of lost (or stalled) placed workers if fetching stalls on one.

        All at once first (one gather: ~2 ms against ~6 ms for a step's three results one by one, measured), bounded
        by a second; on a timeout or an error, one by one under the watch (below), which tells a lost worker from
        a task's own error."""
        try:
            return list(self.client.sync(self.client._gather, list(futures), callback_timeout=1.0))
        except (Exception, CancelledError):  # noqa: BLE001 - the watched path below decides what it was
            pass
        out = []
        for f in futures:
            while True:
                try:
                    out.append(f.result(timeout=1.0))
                    break
                except TimeoutError:
                    bad = self._check()
                    if bad:
                        return bad
                except Exception:  # a task that failed because its worker restarted under it: retry, not fail
                    lost = self._lost_workers()
                    # a rank fails as soon as a peer's connection drops, which can be before the scheduler has
                    # seen the peer's worker go: look a little longer before calling the error the run's
                    deadline = time.monotonic() + (10.0 if self.ranks > 1 else 0.0)
                    while not lost and time.monotonic() < deadline:
                        time.sleep(1.0)
                        lost = self._lost_workers()
                    if lost:
                        return lost
                    raise
        return out

    def failure(self, workers: set[str], busy: set[str] = frozenset()) -> tuple[str, str]:
        """(what failed, what to change) for placed `workers` lost or stalled (the stalls recorded by the watch),
        `busy`: actor rank workers left in a rank node (maybe blocked in a collective)."""
        stalls = self._watch["stalls"]
        parts, kinds = [], set()
        for a in sorted(workers):
            kind = stalls[a].kind if a in stalls else "lost"
            kinds.add(kind)
            parts.append(f"worker {self.name(a)} " + {"lost": "lost (left the cluster or restarted)",
                                                       "paused": "paused for memory",
                                                       "stuck": "stuck in a task", "silent": "not heard from"}[kind])
        for a in sorted(set(busy) - set(workers)):
            parts.append(f"actor rank worker {self.name(a)} left in a rank node")
        fixes = []
        if kinds & {"lost", "paused"}:
            fixes.append(f"raise cluster.memory_limit (now {self.cfg.cluster.memory_limit}) if the worker ran out "
                         f"of memory" if "paused" not in kinds else
                         f"raise cluster.memory_limit (now {self.cfg.cluster.memory_limit}) or the pause fraction "
                         f"(DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE)")
        if kinds & {"stuck", "silent"}:
            fixes.append(f"raise runner.stall_timeout_s (now {self.cfg.runner.stall_timeout_s:g}) if such a task is "
                         f"legitimately this slow")
        return ", ".join(parts) or "placed workers lost", " or ".join(fixes) or "see the workers' logs"

    # ----- recovery -----
    def drop(self, futures) -> None:
        """Give up a failed attempt's futures: release them (the scheduler forgets every node of the graph that
        nobody else wants; a node executing on a live worker finishes there and is discarded).

        Not `client.cancel`: it cancels each key's dependents as well and asserts that someone wants each of them,
        which an inner node (`update_handle` between `actor_update` and `step_metrics`) does not: the assertion
        fails in the scheduler's handler of this client's stream, the scheduler drops the client and with it every
        future it holds, the current weights included (the retry then fails with "lost dependencies").
        """
        for f in futures:
            f.release()

    def busy_rank_workers(self, graph) -> set[str]:
        """Actor rank workers processing one of `graph`'s rank nodes (actor_update_r*, actor_state_r*) now."""
        if self.ranks == 1:
            return set()
        mine = {k for k in graph.layers if str(k).startswith(("actor_update_r", "actor_state_r"))}
        ranks = self.placement.actor_workers[:self.ranks]
        try:
            processing = self.client.processing()  # live workers only: a lost one is restarted anyway
        except Exception:  # noqa: BLE001 - a scheduler that cannot answer: assume the worst (restart them)
            return set(ranks)
        return {w for w, keys in processing.items() if w in ranks and mine & {str(k) for k in keys}}

    def restart(self, workers: list[str]) -> list[str]:
        """Restart `workers` through their Nannies (bounded); returns those that could not be restarted."""
        if not workers:
            return []
        try:
            status = self.client.restart_workers(workers, timeout=self.CALL_TIMEOUT_S, raise_for_error=False)
        except Exception as exc:  # noqa: BLE001 - reported, and the caller treats them as unhealthy
            status = {w: repr(exc) for w in workers}
        return [w for w in workers if status.get(w) != "OK"]

    def run_on(self, fn, *args, workers: list[str] | None = None, what: str) -> None:
        """`client.run(fn, *args)` on `workers` (errors ignored), bounded by CALL_TIMEOUT_S."""
        try:
            bounded(self.client.run, fn, *args, workers=workers, on_error="ignore",
                    timeout=self.CALL_TIMEOUT_S, what=what)
        except TimeoutError as exc:
            self.echo(f"dagrl: {exc}; going on without it")

    def release_groups(self, workers: list[str], run_id: str, generation: int,
                       restart: set[str] = frozenset()) -> None:
        """Free run `run_id`'s actor process groups (of `generation`, for the line) on `workers`: restart those in
        `restart` (a thread blocked in a collective cannot be interrupted; the Nanny starts a fresh process), destroy
        the group on the others."""
        from tasks.actor.distributed import release_group
        restart = [w for w in workers if w in restart]
        if restart:
            failed = self.restart(restart)
            if failed:  # no nanny: the blocked rank raises after its group's timeout (distributed.DEFAULT_TIMEOUT_S)
                self.echo(f"dagrl: could not restart actor worker(s) {failed}; their ranks stay blocked "
                          f"until the process group's timeout")
        rest = [w for w in workers if w not in restart]
        if rest:
            self.run_on(release_group, run_id, workers=rest, what="releasing the actor process groups")
        self.echo(f"dagrl: actor process group (generation {generation}) dropped: restarted "
                  f"{restart or 'no worker'}, released on {rest or 'no worker'}")

    def healthy_placement(self, exclude: set[str]):
        """`plan_placement` on the live, running workers not in `exclude`; retried for up to 120 s while restarted
        workers come back. Raises PlacementError when none exists."""
        deadline = time.monotonic() + 120.0
        while True:
            info = cluster_info(self.client)
            live = info["workers"]
            healthy = {a: w for a, w in live.items() if a not in exclude and w.get("status", "running") == "running"}
            try:
                return plan_placement(self.cfg, {**info, "workers": healthy})
            except ConfigError:
                # no waiting when the live workers could hold it: then the unhealthy ones are why
                if time.monotonic() > deadline or (exclude and self.placeable(info)):
                    raise
                time.sleep(1.0)

    def placeable(self, info: dict) -> bool:
        try:
            plan_placement(self.cfg, info)
            return True
        except ConfigError:
            return False

    def cluster_gone(self) -> str | None:
        """None while the scheduler answers (within 30 s), else why not. (`scheduler_info()` cannot tell: it
        returns the last answer when the scheduler is unreachable.)"""
        status = getattr(self.client, "status", "running")
        if status != "running":
            return f"the client's connection to the scheduler is {status}"
        try:
            bounded(self.client.sync, self.client.scheduler.identity, timeout=30.0, what="the scheduler")
        except Exception as exc:  # noqa: BLE001 - that is the answer
            return f"the scheduler does not answer ({type(exc).__name__}: {one_line(exc)})"
        return None

    # ----- the recovery decision -----
    def plan_recovery(self, lost: set[str], busy: set[str], *, run_id: str, generation: int) -> RecoveryPlan:
        """What to do after placed workers `lost` were lost or stalled (`busy`: actor rank workers left in a rank
        node): restart the stuck or silent ones (they then count as lost), leave paused ones out, and re-plan the
        placement on the healthy workers once the cluster's workers are back. The actor is lost when one of its
        rank workers is, or any rank was busy (a cancelled rank may be blocked in a collective and a retry must not
        pair with it); with several ranks the surviving rank workers are restarted (busy) or their groups of
        run `run_id` (`generation`) destroyed. The recorded stalls are consumed.

        Raises:
            NoPlacement: the cluster's workers are not back, or no placement exists on the healthy ones (the
                give-up line's parts; `actor_healthy` when the actor was not lost)."""
        cfg = self.cfg
        failed, fix = self.failure(lost, busy)
        stalls, self._watch["stalls"] = self._watch["stalls"], {}
        paused = {a for a in lost if a in stalls and stalls[a].kind == "paused"}
        stuck = [a for a in sorted(lost) if a in stalls and stalls[a].kind != "paused"]
        paused |= set(self.restart(stuck))  # a stuck worker that cannot be restarted stays out of the placement
        ranks = self.placement.actor_workers[:self.ranks]
        actor_lost = bool(lost & set(ranks)) or bool(busy)
        if actor_lost and self.ranks > 1:
            self.release_groups([w for w in ranks if w not in lost], run_id, generation, restart=set(busy) - paused)
        n, wait_s = rejoin(cfg)  # the kind's whole cluster and how long to wait for it
        have = wait_for_workers(self.client, n, wait_s)  # any state: paused ones count (not Client's)
        if have < n:
            raise NoPlacement(f"{failed}, and only {have} of the cluster's {n} workers are back {wait_s:.0f} s later",
                              f"{fix}; check that the machine can hold {n} workers (cluster.num_env_workers, "
                              f"cluster.memory_limit) and see the workers' logs", not actor_lost)
        try:
            placement = self.healthy_placement(paused)
        except ConfigError as exc:
            live = cluster_info(self.client)["workers"]
            paused |= {a for a, w in live.items() if w.get("status", "running") != "running"}
            why = (f"{failed}: no healthy placement without the paused worker(s) {sorted(paused)}" if paused
                   else f"{failed}: no placement on the live workers")
            # the placement's own fix only when the cluster could not hold it even with every worker healthy
            # (all paused: "no worker with resource GPU" is the pause, and `fix` already names its cure)
            whole = {**cluster_info(self.client), "workers": live}
            raise NoPlacement(why, fix if paused and self.placeable(whole) else f"{fix}, or {exc.fix}",
                              not actor_lost) from None
        return RecoveryPlan(placement, actor_lost, paused, bool(stalls))


__all__ = ["NoPlacement", "RecoveryPlan", "RunStalled", "Stall", "Watcher", "bounded", "one_line", "PlacementError"]
