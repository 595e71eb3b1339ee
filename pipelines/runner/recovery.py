"""Recovery of a run from lost and stalled workers: the Runner's watch over its placed workers.

`Recovery` is a mixin of `pipelines.runner.Runner` (it uses the runner's `cfg`, `client`, `placement`,
`_placed_ids`, `state`, `ranks`, `run_dir`, `echo`, `_init_actor`, `checkpoint`). Every wait of the driver on
the cluster goes through `_wait_or_lost` / `_fetch_or_lost` (or `_result`, which raises instead of returning):
they return the placed workers that left the cluster, or that are alive but make no progress, within a bound.

What counts as no progress (checked once a second while waiting, from the scheduler's view of each placed worker):

| worker state                                   | bound                                                   |
|------------------------------------------------|---------------------------------------------------------|
| `paused` (memory above its pause fraction)     | `runner.pause_timeout_s` without a break                 |
| a task executing far past its expected time    | max(`runner.stall_timeout_s`, 4 x the longest finished   |
| (blocked in a collective, a hung simulator)    | task of the same kind seen in this run)                 |
| not heard from (event loop blocked)            | `runner.stall_timeout_s`                                 |

A stall prints one line naming the worker, its state, its memory and the key to change, then `_recover`: a worker
stuck in a task is restarted (its Nanny starts a fresh process; it then counts as lost), a paused one is left out
of the new placement. If a placement on the healthy workers exists the step is retried on it; if not, the run
stops (`RunStalled`, exit 1): with a checkpoint of the last finished step when the actor's workers are healthy
(their weights are the last good ones), else naming the latest checkpoint on disk, and the command to resume.

Every way a run gives up ends in `_give_up`, which raises `RunStalled` with ONE line (pipelines.run prints it as
`error: <line>`, exit 1, no traceback):

    training step N: <what failed: the worker(s) and their state>; <what was saved: the checkpoint path>; <what to change>

| give-up path                                                          | raised from                         |
|-----------------------------------------------------------------------|-------------------------------------|
| every attempt of a step / eval / checkpoint lost or stalled workers   | Scheduler._retrying (max_retries)   |
| no placement on the healthy workers after a loss or a stall           | `_recover`                          |
| the cluster's workers not back after a loss                           | `_recover`                          |
| the cluster itself gone (scheduler unreachable) during a wait         | Scheduler._retrying (`_cluster_gone`) |
| a task of the checkpoint graph failed (disk full, permissions)        | Scheduler._compute                  |
| placed workers lost or stalled in the init graph (no retry path)      | `_result`                           |

N is the training step that failed, numbered as MLflow's (the first step is 1); for an evaluation or checkpoint
graph it is the step they follow. The checkpoint is written (of the last finished step, with the watch narrowed to
the actor's workers: a lost env worker does not stop it) whenever the actor's workers are healthy; else the line
names the latest checkpoint on disk, or says that none exists.

Driver calls outside the watch that could block (`client.run`, `restart_workers`, `wait_for_workers`) carry a
bound (`bounded`, their own `timeout`).
"""
from __future__ import annotations

import re
import threading
import time
from asyncio import CancelledError
from dataclasses import dataclass

from pipelines.cluster import (PlacementError, cluster_info, pause_fraction, plan_placement, wait_for_workers,
                               worker_health)
from storage.checkpoints import latest_checkpoint
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


def bounded(fn, *args, timeout: float, what: str, **kwargs):
    """`fn(*args, **kwargs)` in a daemon thread, its result within `timeout` seconds.

    Raises:
        TimeoutError: naming `what` and the bound (the thread is left behind; it cannot keep the process alive).
        Whatever `fn` raises.
    """
    box: dict = {}

    def call():
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = exc

    t = threading.Thread(target=call, daemon=True, name=f"dagrl-{what[:20]}")
    t.start()
    t.join(timeout)
    if "err" in box:
        raise box["err"]
    if "out" not in box:
        raise TimeoutError(f"{what} did not answer within {timeout:.0f} s")
    return box["out"]


def _kind(key: str) -> str:
    """Task kind of a key: its name up to the first dash, digits dropped (`env_step_s1-run-3-0` -> `env_step_s`)."""
    return re.sub(r"\d+", "", str(key).split("-", 1)[0])


def _gib(n) -> str:
    return "unknown" if n is None else (f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB")


class Recovery:
    """Lost- and stalled-worker detection and recovery, mixed into `pipelines.runner.Runner`."""

    CALL_TIMEOUT_S = 120.0  # bound of one driver call to the workers outside the watch (client.run, restarts)

    # ----- the watch -----
    def _placed(self) -> set[str]:
        p = self.placement
        only = getattr(self, "_watch_only", None)  # while writing the give-up checkpoint: the actor's workers
        return set(only) if only else {*p.shard_workers, *p.actor_workers[:self.ranks], *p.rollout_workers}

    def _watch_state(self) -> dict:
        w = getattr(self, "_watch", None)
        if w is None:
            w = self._watch = {"paused_since": {}, "executing": {}, "longest": {}, "stalls": {},
                               "t0": time.perf_counter()}  # first watched wait (the init graph): ~ the run's start
        return w

    def _start_watch(self) -> None:
        """Called before each wait: forget the previous wait's stalls and pause clocks (kept: the longest task
        durations, the expected times)."""
        w = self._watch_state()
        w["paused_since"], w["executing"], w["stalls"] = {}, {}, {}

    def _stalled_workers(self) -> dict[str, Stall]:
        """Placed workers alive but without progress beyond their bound (one scheduler query). Prints nothing."""
        r, w = self.cfg.runner, self._watch_state()
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
            w = self._watch_state()
            w["stalls"] = stalls
            self.echo("; ".join(s.line for s in stalls.values()))
            return set(stalls)
        return set()

    # ----- waiting -----
    def _worker_ids(self) -> dict[str, str]:
        """address -> worker id (a restarted worker can come back on the same address with a new id and no state).
        Also remembers each address's worker name (`_name`: a lost worker is named after it is gone)."""
        workers = cluster_info(self.client)["workers"]
        names = self.__dict__.setdefault("_names", {})
        names.update({a: w.get("name", a) for a, w in workers.items()})
        return {a: w.get("id", a) for a, w in workers.items()}

    def _placed_worker_ids(self, tries: int = 5) -> dict[str, str]:
        """`_worker_ids()` once it lists every worker of the placement (up to `tries` looks 1 s apart): the ids the
        watch compares with later. A starved machine's scheduler_info() can list none of the live workers (see
        `_lost_workers`); recorded here, such an answer made every placed worker look "restarted" at the next
        check (seen once in the full suite: a killed env worker's recovery followed by a second, spurious loss of
        all workers and a rollback)."""
        placed = self._placed()
        ids = self._worker_ids()
        for _ in range(tries - 1):
            if placed <= set(ids):
                break
            time.sleep(1.0)
            ids = self._worker_ids()
        return ids

    def _name(self, addr: str) -> str:
        return f"{self.__dict__.get('_names', {}).get(addr, '?')} ({addr})"

    def _lost_workers(self) -> set[str]:
        """Placed workers gone (or restarted with a new id), confirmed by a second look 2 s later: on a starved
        machine one scheduler_info() answer was seen to list none of the workers that were still alive (the
        client's cache, overwritten by its periodic update: `pipelines.cluster.cluster_info` asks the scheduler
        directly now; the second look stays). The placed workers are `_placed()`'s: env, actor and rollout
        (inference) workers, or the watch's narrowed set."""
        placed = self._placed()

        def missing() -> set[str]:
            now = self._worker_ids()
            return {a for a in placed if now.get(a) != self._placed_ids.get(a)}
        lost = missing()
        if lost:
            time.sleep(2.0)
            lost &= missing()
        return lost

    def _wait_or_lost(self, futures) -> set[str]:
        """Wait for `futures`; return the placed worker addresses that left the cluster or stalled meanwhile
        (empty: done). Stalls are recorded for `_recover` and printed (one line).

        A task pinned to a worker that died would wait forever in `no-worker`, and one pinned to a paused worker
        forever in `processing`, so the placed workers are checked every second while waiting.
        """
        from distributed import wait
        self._start_watch()
        while True:
            try:
                wait(futures, timeout=1.0)
                return set()
            except TimeoutError:
                bad = self._check()
                if bad:
                    return bad

    def _fetch_or_lost(self, futures) -> list | set[str]:
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

    def _result(self, futures: list, what: str) -> list:
        """Results of `futures` under the watch, for waits without a retry path (the init graph).

        Raises:
            RunStalled: a placed worker was lost or stalled (the line was printed), with what to do next.
        """
        self._start_watch()
        bad = self._wait_or_lost(futures)
        results = bad if bad else self._fetch_or_lost(futures)
        if isinstance(results, list):
            return results
        failed, fix = self._failure(results)
        self._give_up(f"{what}: {failed}", fix, actor_healthy=False, unsaved="the actor is not initialised")

    def _resume_hint(self, ckpt) -> str:
        st = self.state
        if ckpt is None:
            return "then start it again (no checkpoint to resume from)"
        return f"then resume with `python -m pipelines.run conf=<this config> runner.resume={st.run_id}`"

    def _failure(self, workers: set[str], busy: set[str] = frozenset()) -> tuple[str, str]:
        """(what failed, what to change) for placed `workers` lost or stalled (the stalls recorded by the watch),
        `busy`: actor rank workers left in a rank node (maybe blocked in a collective)."""
        stalls = self._watch_state()["stalls"]
        parts, kinds = [], set()
        for a in sorted(workers):
            kind = stalls[a].kind if a in stalls else "lost"
            kinds.add(kind)
            parts.append(f"worker {self._name(a)} " + {"lost": "lost (left the cluster or restarted)",
                                                       "paused": "paused for memory",
                                                       "stuck": "stuck in a task", "silent": "not heard from"}[kind])
        for a in sorted(set(busy) - set(workers)):
            parts.append(f"actor rank worker {self._name(a)} left in a rank node")
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

    def _give_up(self, failed: str, fix: str, *, actor_healthy: bool, step: int | None = None,
                 unsaved: str = "the actor's weights were on the failed worker(s)"):
        """End the run with RunStalled (module docstring's one line); never returns.

        failed: what failed (workers and their state); fix: what to change. actor_healthy: the actor's workers
        hold the last finished step's weights, so a checkpoint of it is written first (the watch narrowed to them);
        else the latest checkpoint on disk is named (unsaved: why none was written). step: the N of the line
        (default: the step being trained).
        """
        st = self.state
        if st is None:  # a Watcher: no run, no steps, nothing to save
            raise RunStalled(f"{failed}; nothing saved (no run); {fix}")
        n = st.step + 1 if step is None else step
        if getattr(self, "_stopping_stalled", False):  # failed while writing the give-up checkpoint: _give_up's
            raise RunStalled(failed)  # caller reports it (in its own line)
        self._stopping_stalled = True
        ckpt, why = None, unsaved
        if actor_healthy:
            t_start = getattr(self, "_t_start", None) or self._watch_state()["t0"]  # Runner.run's, if it sets one
            elapsed = st.elapsed_s + time.perf_counter() - t_start
            self._watch_only = set(self.placement.actor_workers[:self.ranks])
            try:
                ckpt = self.checkpoint(elapsed)
            except Exception as exc:  # noqa: BLE001 - said in the line; the latest checkpoint is named instead
                why = f"writing it failed: {one_line(exc)}"
            finally:
                self._watch_only = None
        if ckpt is not None:
            saved = f"wrote checkpoint {ckpt} (step {st.step}, the last finished step)"
        else:
            ckpt = latest_checkpoint(self.run_dir) if getattr(self, "run_dir", None) is not None else None
            saved = (f"no checkpoint written ({why}); " +
                     (f"the latest is {ckpt}" if ckpt is not None else "no checkpoint of this run exists yet"))
        raise RunStalled(f"training step {n}: {failed}; {saved}; {fix}, {self._resume_hint(ckpt)}")

    # ----- recovery -----
    def _drop(self, futures) -> None:
        """Give up a failed attempt's futures: release them (the scheduler forgets every node of the graph that
        nobody else wants; a node executing on a live worker finishes there and is discarded).

        Not `client.cancel`: it cancels each key's dependents as well and asserts that someone wants each of them,
        which an inner node (`update_handle` between `actor_update` and `step_metrics`) does not: the assertion
        fails in the scheduler's handler of this client's stream, the scheduler drops the client and with it every
        future it holds, the current weights included (the retry then fails with "lost dependencies").
        """
        for f in futures:
            f.release()

    def _busy_rank_workers(self, graph) -> set[str]:
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

    def _restart(self, workers: list[str]) -> list[str]:
        """Restart `workers` through their Nannies (bounded); returns those that could not be restarted."""
        if not workers:
            return []
        try:
            status = self.client.restart_workers(workers, timeout=self.CALL_TIMEOUT_S, raise_for_error=False)
        except Exception as exc:  # noqa: BLE001 - reported, and the caller treats them as unhealthy
            status = {w: repr(exc) for w in workers}
        return [w for w in workers if status.get(w) != "OK"]

    def _run_on(self, fn, *args, workers: list[str] | None = None, what: str) -> None:
        """`client.run(fn, *args)` on `workers` (errors ignored), bounded by CALL_TIMEOUT_S."""
        try:
            bounded(self.client.run, fn, *args, workers=workers, on_error="ignore",
                    timeout=self.CALL_TIMEOUT_S, what=what)
        except TimeoutError as exc:
            self.echo(f"dagrl: {exc}; going on without it")

    def _release_groups(self, workers: list[str], restart: set[str] = frozenset()) -> None:
        """Free the actor process groups on `workers`: restart those in `restart` (a thread blocked in a collective
        cannot be interrupted; the Nanny starts a fresh process), destroy the group on the others."""
        from tasks.distributed import release_group
        restart = [w for w in workers if w in restart]
        if restart:
            failed = self._restart(restart)
            if failed:  # no nanny: the blocked rank raises after its group's timeout (distributed.DEFAULT_TIMEOUT_S)
                self.echo(f"dagrl: could not restart actor worker(s) {failed}; their ranks stay blocked "
                          f"until the process group's timeout")
        rest = [w for w in workers if w not in restart]
        if rest:
            self._run_on(release_group, self.state.run_id, workers=rest, what="releasing the actor process groups")
        self.echo(f"dagrl: actor process group (generation {self.state.actor_generation}) dropped: restarted "
                  f"{restart or 'no worker'}, released on {rest or 'no worker'}")

    def _healthy_placement(self, exclude: set[str]):
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
                if time.monotonic() > deadline or (exclude and self._placeable(info)):
                    raise
                time.sleep(1.0)

    def _placeable(self, info: dict) -> bool:
        try:
            plan_placement(self.cfg, info)
            return True
        except ConfigError:
            return False

    def _stop(self, why: str, fix: str, actor_healthy: bool) -> None:
        """Stop the run (`_give_up`): checkpoint the last finished step when the actor is healthy."""
        self._give_up(why, fix, actor_healthy=actor_healthy)

    def _recover(self, lost: set[str], step: int, busy: set[str] = frozenset(), during: str | None = None) -> None:
        """Re-plan placement on the healthy workers and drop resident env shards so that every shard is re-created
        from the step's seed cursor. If the actor's worker was lost or stalled (its weights and optimizer with
        it), roll the run back to the latest checkpoint (or to a fresh actor when there is none yet).

        Stalled workers (`_wait_or_lost`): stuck or silent ones are restarted and then count as lost; paused ones
        are left out of the placement. No placement on the healthy workers: `_stop` (RunStalled).

        Multi-rank actor: the loss of any rank's worker, or any loss while rank nodes were running (`busy`: a
        cancelled rank may be blocked in a collective, and a retry must not pair with it), breaks the group:
        the surviving rank workers are restarted (busy) or their groups destroyed, the run rolls back to the last
        checkpoint and the group is rebuilt in the next generation on a new port.

        `step`: the last finished step (the rollback's key tag); `during`: what was running, for the line (default
        "step <step + 1>", the training step in flight)."""
        cfg, st = self.cfg, self.state
        if getattr(self, "_stopping_stalled", False):  # not reached (no retry while stopping): a safe bound
            raise RunStalled(f"training step {st.step + 1}: worker(s) {sorted(lost)} lost or stalled while "
                             f"writing the give-up checkpoint")
        failed, fix = self._failure(lost, busy)
        stalls = self._watch_state()["stalls"]
        self._watch_state()["stalls"] = {}
        paused = {a for a in lost if a in stalls and stalls[a].kind == "paused"}
        stuck = [a for a in sorted(lost) if a in stalls and stalls[a].kind != "paused"]
        paused |= set(self._restart(stuck))  # a stuck worker that cannot be restarted stays out of the placement
        ranks = self.placement.actor_workers[:self.ranks]
        actor_lost = bool(lost & set(ranks)) or bool(busy)
        if actor_lost and self.ranks > 1:
            self._release_groups([w for w in ranks if w not in lost], restart=set(busy) - paused)
        n = cfg.cluster.num_env_workers + cfg.cluster.num_gpu_workers if cfg.cluster.address is None else 1
        wait_s = max(120.0, cfg.cluster.connect_timeout_s)
        have = wait_for_workers(self.client, n, wait_s)  # any state: paused ones count (not Client's)
        if have < n:
            self._stop(f"{failed}, and only {have} of the cluster's {n} workers are back {wait_s:.0f} s later",
                       f"{fix}; check that the machine can hold {n} workers (cluster.num_env_workers, "
                       f"cluster.memory_limit) and see the workers' logs", actor_healthy=not actor_lost)
        try:
            placement = self._healthy_placement(paused)
        except ConfigError as exc:
            live = cluster_info(self.client)["workers"]
            paused |= {a for a, w in live.items() if w.get("status", "running") != "running"}
            why = (f"{failed}: no healthy placement without the paused worker(s) {sorted(paused)}" if paused
                   else f"{failed}: no placement on the live workers")
            # the placement's own fix only when the cluster could not hold it even with every worker healthy
            # (all paused: "no worker with resource GPU" is the pause, and `fix` already names its cure)
            whole = {**cluster_info(self.client), "workers": live}
            self._stop(why, fix if paused and self._placeable(whole) else f"{fix}, or {exc.fix}",
                       actor_healthy=not actor_lost)
        self.echo(f"dagrl: worker(s) {sorted(lost)} {'lost or stalled' if stalls else 'lost'} during "
                  f"{during or f'step {step + 1}'}; "
                  f"{'restoring the actor from the last checkpoint and ' if actor_lost else ''}retrying"
                  + (f" without {sorted(paused)}" if paused else ""))
        self.placement = placement
        self._placed_ids = self._placed_worker_ids()
        from tasks import resident
        self._run_on(resident.release, f"{st.run_id}/shard/", what="releasing the env shards")
        if actor_lost:
            ckpt = latest_checkpoint(self.run_dir)
            self._rollback(ckpt)  # Runner: RunState from the checkpoint (or fresh), one timeline in store/MLflow
            if self.ranks > 1:
                st.actor_generation += 1
            tag = f"r{step}" + (f"-g{st.actor_generation}" if self.ranks > 1 else "")
            self.weights, _ = self._init_actor({"path": str(ckpt)} if ckpt else None, tag=tag)



class Watcher(Recovery):
    """The same watch for drivers without a Runner and without a retry path (`pipelines.record`): `results(futures,
    what)` waits for them, and a placed worker lost or stalled meanwhile ends the wait with RunStalled (after the
    one line naming it) instead of a silent hang."""

    def __init__(self, cfg, client, placement, echo=print):
        self.cfg, self.client, self.placement, self.echo = cfg, client, placement, echo
        self.ranks, self.run_dir, self.state = 1, None, None
        self._placed_ids = self._placed_worker_ids()

    def results(self, futures, what: str) -> list:
        """Results of `futures`, in order. Raises RunStalled (see `Recovery._result`)."""
        return self._result(list(futures), what)


__all__ = ["Recovery", "RunStalled", "Stall", "Watcher", "bounded", "one_line", "PlacementError"]
