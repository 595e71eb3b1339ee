"""The step scheduler: one loop submits training-step graphs, waits for the oldest, retries after a loss.

Synchronous is asynchronous with `runner.max_staleness` = k = 0. The scheduler keeps up to k step graphs submitted
ahead of the one it waits for. Step j's rollout takes the weights of step j-k (`v(j-k)`: the rollout of step n+1
runs on v(n) while update n runs; the newest weights when nothing is in flight, so with k = 0 every rollout is
on-policy), its update the previous update's output, its first env nodes follow step j-1's last ones (only while
step j-1 is in flight: a drained pipeline needs no ordering); the actor corrects with decoupled PPO
(tasks.update.actor_update). Nothing is submitted ahead across a step after which an eval or a checkpoint follows,
nor beyond `max_steps`/`max_env_steps`: an eval or checkpoint always sees a drained pipeline, so a checkpoint holds
exactly what a synchronous one does (a resumed run refills the pipeline from v(n)). With k = 0 the graphs and keys
are those of one step at a time: `build_train_step(weights=v(j))`, keys `...-{run}-{j}` and `-retry{n}` for the n-th
resubmission of step j.

Failures (`_retrying`, the one retry loop, also used by `_compute` for the single graphs: init, eval, SFT,
checkpoint): a lost or stalled placed worker (pipelines.runner.recovery) drops every graph in flight, `_recover`
re-places (and after a lost actor rolls back to the last checkpoint), and the pipeline refills from the current
step and weights, up to `runner.max_retries` times; then, or when no healthy placement is left, the cluster is gone
or the checkpoint graph itself fails, the run gives up with `RunStalled` (pipelines.runner.recovery: one line
`training step N: <what failed>; <what was saved>; <what to change>`, the checkpoint written when the actor's
workers are healthy). A non-finite value that stops a step inside a task
(tasks.update.NonFiniteError, the env shard's one-line ValueError) ends the run with `StepFailed`, one line naming
the training step (numbered as MLflow's: the first step is 1).
"""
from __future__ import annotations

import time
from asyncio import CancelledError
from dataclasses import dataclass, field

from pipelines import graphs
from pipelines.runner.recovery import RunStalled, bounded, one_line
from tasks.config import ConfigError


def _merged(sg, store_graph):
    """Step graph `sg` (a StepGraph) and its store writes (`graphs.build_step_store`) as one HighLevelGraph, each
    store node depending on its shard's trajectory node: what the perf accounting and the recovery read."""
    from dask.highlevelgraph import HighLevelGraph
    deps = {**sg.graph.dependencies}
    for s, key in enumerate(store_graph.layers):
        deps[key] = {sg.trajs[s]}
    return HighLevelGraph({**sg.graph.layers, **store_graph.layers}, deps)


class StepFailed(RuntimeError):
    """A training step failed inside a task for a reason a retry does not fix (a non-finite value); one line."""


@dataclass
class Lost:
    """An attempt that failed because placed workers were lost or stalled (`busy`: actor rank workers that were
    running one of its rank nodes, see Recovery._recover)."""

    workers: set
    busy: set = field(default_factory=set)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _is_nonfinite(exc: BaseException) -> bool:
    from tasks.update import NonFiniteError
    return isinstance(exc, NonFiniteError) or (isinstance(exc, ValueError) and str(exc).startswith("non-finite"))


class Scheduler:
    """The step scheduler of `pipelines.runner.Runner` (see the module docstring)."""

    # ----- the one retry loop -----
    def _retrying(self, once, what: str):
        """`once(attempt)` until it returns something other than `Lost`; after a `Lost`, `_recover` and again, up
        to `runner.max_retries` retries (none while writing a give-up checkpoint).

        what: "training step" | "SFT step" (N of the give-up line: the step being run) or the name of a graph that
        follows step N ("evaluation", "checkpoint").

        Raises:
            RunStalled: every attempt lost or stalled workers (the checkpoint written when the actor's workers are
                healthy), `_recover` found no healthy placement, or the cluster is gone (`_cluster_gone`).
        """
        stepping = what in ("training step", "SFT step")
        n = self.state.step + (1 if stepping else 0)
        prefix = "" if stepping else f"{what}: "
        R = 0 if getattr(self, "_stopping_stalled", False) else self.cfg.runner.max_retries
        for attempt in range(R + 1):
            out = self._guarded(lambda: once(attempt), prefix, n)
            if not isinstance(out, Lost):
                return out
            if attempt < R:
                self._perf("retry", what, n)
                during = f"step {n}" if stepping else f"the {what} of step {n}"  # n: the step being run
                self._guarded(lambda: self._recover(out.workers, self.state.step, out.busy, during=during), prefix, n)
        failed, fix = self._failure(out.workers, out.busy)
        ranks = set(self.placement.actor_workers[:self.ranks])
        self._give_up(f"{prefix}{failed}, on each of {R + 1} attempt(s) (runner.max_retries={R})",
                      f"{fix}, or raise runner.max_retries (now {R})",
                      actor_healthy=not (out.workers & ranks) and not out.busy, step=n)

    def _perf(self, event: str, *args):
        """`self.perf.<event>(*args)` (pipelines.runner.perf.PerfRecorder) when the runner has one."""
        perf = getattr(self, "perf", None)
        return None if perf is None else getattr(perf, event)(*args)

    def _guarded(self, fn, prefix: str, n: int):
        """`fn()`; an error while the cluster is gone (`_cluster_gone`) becomes the give-up line, others pass."""
        try:
            return fn()
        except (RunStalled, StepFailed, ConfigError):
            raise
        except (Exception, CancelledError) as exc:  # a future cancelled by a lost scheduler is a CancelledError
            gone = self._cluster_gone()
            if gone is None:
                raise
            self._give_up(f"{prefix}the cluster is gone: {gone} (the wait ended with {type(exc).__name__}: "
                          f"{one_line(exc)})", "check the scheduler and its workers (cluster.address, or the "
                          "embedded cluster's log)", actor_healthy=False, step=n,
                          unsaved="the actor's weights were on the cluster")

    def _cluster_gone(self) -> str | None:
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

    def _await(self, futs: list, keep: int) -> list | set:
        """The results of `futs[keep:]` once all of `futs` are done, or the lost/stalled placed workers (a set).
        Results are fetched under the same watch: a result held by a worker that dies after finishing would
        otherwise be recomputed from pinned tasks that can no longer run, and the fetch would wait forever."""
        lost = self._wait_or_lost(futs)
        return lost if lost else self._fetch_or_lost(futs[keep:])

    def _compute(self, build, what: str, keep: int = 0) -> tuple[list, list]:
        """Submit `build(attempt) -> (graph, keys)`, wait and fetch under the watch, retrying after a loss
        (`_retrying`). Returns (the first `keep` keys as futures, the results of the others)."""
        def once(attempt: int):
            graph, keys = build(attempt)
            futs = self.client.get(graph, keys, sync=False)
            try:
                got = self._await(futs, keep)
            except (Exception, CancelledError) as exc:
                from tasks.update import ActorMissing
                if self._cluster_gone() is not None or not (what == "checkpoint" or isinstance(exc, ActorMissing)):
                    raise
                self._drop(futs)  # a checkpoint task failed (disk full, permissions), or the actor is gone: no retry
                if isinstance(exc, ActorMissing):  # the actor's worker was restarted (a checkpoint, or an eval of
                    # its averaged weights, reads the resident actor): not a disk problem
                    self._give_up(f"{what}: the actor of step {self.state.step} is gone from its worker (the "
                                  f"worker process was restarted: {one_line(exc)})",
                                  "resume from the last checkpoint; if workers were killed from outside (a signal "
                                  "to the driver alone stops the run gracefully), find what killed them",
                                  actor_healthy=False, step=self.state.step, unsaved="the actor's state was lost")
                self._give_up(f"checkpoint: writing the checkpoint of step {self.state.step} under {self.run_dir} "
                              f"failed ({type(exc).__name__}: {one_line(exc)})",
                              f"check that run_root ({self.cfg.run_root}) is writable and has free space",
                              actor_healthy=False, step=self.state.step, unsaved="writing it is what failed")
            if isinstance(got, list):
                return futs[:keep], got
            busy = self._busy_rank_workers(graph)  # before dropping: dropped tasks leave the scheduler's view
            self._drop(futs)  # recovery: release, not cancel (see there)
            return Lost(got, busy)

        return self._retrying(once, what)

    # ----- training steps -----
    def train_step(self) -> dict:
        """Wait for the oldest step in flight, after topping the pipeline up to `max_staleness` steps ahead; on a
        lost worker, recover and retry (up to `runner.max_retries`). Returns the step's metrics.

        Raises:
            StepFailed: a non-finite value stopped the step (one line naming it).
        """
        if self.cfg.algorithm.name == "sft":
            return self.sft_step()
        st, k = self.state, self.cfg.runner.max_staleness
        t0 = time.perf_counter()

        def once(attempt: int):
            if not self._ahead:
                self._submit_step()
            while len(self._ahead) <= k and self._may_submit_ahead(st.step + len(self._ahead)):
                self._submit_step()
            step = self._ahead[0][0]
            got = self._store_step(step)  # once its rollout is done: the store bookkeeping, during its update
            try:
                got = got or self._await(self._ahead[0][2], keep=1)
            except Exception as exc:
                if not _is_nonfinite(exc):
                    raise
                self._cancel_pipeline()
                raise StepFailed(f"training step {step + 1}: {_one_line(exc)}") from exc
            futs = self._ahead[0][2]
            if isinstance(got, set):
                busy = set().union(*(self._busy_rank_workers(g) for _, g, _ in self._ahead))
                self._cancel_pipeline()  # every step in flight: the retry starts from the current step
                return Lost(got, busy)
            _, graph, _ = self._ahead.pop(0)
            for old in [v for v in self._w if v < step + 1 - k]:  # weights no later rollout takes
                del self._w[old]
                self._h.pop(old, None)
            out, *store_out = got
            start = min(t0, self._submitted_at.pop(step, t0))  # a step submitted ahead began before this call
            return self._finish_step(step, futs[0], out, store_out, attempt, start, graph)

        return self._retrying(once, "training step")

    def _reset_pipeline(self) -> None:
        """Start the pipeline afresh from `self.weights` at the current step (`_submit_step` with nothing in flight)."""
        self._ahead: list[tuple[int, object, list]] = []  # submitted steps (step, graph, futures), oldest first
        j, w, h = self.state.step, getattr(self, "_w", {}), getattr(self, "_h", {})
        # the handle of the current weights survives a drain (after every synchronous step) when they are still the
        # weights it was made from (not after a rollback or a re-init: then the step's graph makes one)
        keep = h.get(j) if j in w and w[j] is self.weights else None
        self._w = {j: self.weights}  # step j -> the weights update j starts from (v(j))
        self._h: dict[int, object] = {} if keep is None else {j: keep}  # step j -> a Future of v(j)'s handle
        self._w_base = self.state.step
        self._after: list | None = None  # futures of the newest submitted step's last env nodes
        self._submitted_at: dict[int, float] = {}  # step -> when its graph was submitted (perf_counter)
        self._unstored: dict[int, tuple] = {}  # step -> (trajectory futures, its StepGraph, key attempt): the store
        # writes not submitted yet (_store_step)

    def _may_submit_ahead(self, j: int) -> bool:
        """Whether step j's graph may be submitted while step j-1's is still in flight."""
        r, st = self.cfg.runner, self.state
        return (not self._stopping and j < r.max_steps and j % r.val_check_interval != 0
                and j % r.save_interval != 0
                and (r.max_env_steps is None or st.env_steps + (j - st.step) * self._env_steps_per_step()
                     < r.max_env_steps))

    def _env_steps_per_step(self) -> int:
        c = self.cfg
        return c.env.num_envs * c.rollout.chunk_steps * c.policy.num_action_chunks

    def _submit_step(self) -> None:
        """Submit the next step's graph (j = current step + steps in flight); its store writes follow in
        `_store_step`."""
        cfg, st = self.cfg, self.state
        if not self._ahead:  # drained (start, after an eval/checkpoint, a recovery or a rollback): restart the
            self._reset_pipeline()  # pipeline from the current step and weights, whoever changed them
        j = st.step + len(self._ahead)
        attempt = self._submits.get(j, 0)  # keys unique per resubmission of step j (released keys may linger)
        self._submits[j] = attempt + 1
        ahead = bool(self._ahead)
        # with nothing in flight the newest weights cost no waiting: a drained pipeline restarts on-policy
        v = max(j - cfg.runner.max_staleness, self._w_base) if ahead else j
        behaviour = self._w[v]
        sg = graphs.build_train_step(
            cfg, run_id=st.run_id, step=j, weights=behaviour, cursors=st.cursors, placement=self.placement,
            dims=self.dims, store_path=None, attempt=attempt, group=self._group_specs(),
            actor_weights=self.actor_weights, update_weights=self._w[j] if ahead else None,
            after=self._after if ahead else None, profile_trace=self._update_trace(j + 1),
            weights_handle=self._h.get(v))
        L, trajs = len(sg.last_env), (sg.trajs if self.store is not None else [])
        futs = self.client.get(sg.graph, [sg.update, sg.metrics, sg.handle, *sg.last_env, *trajs], sync=False)
        self._submitted_at[j] = time.perf_counter()
        self._w[j + 1] = futs[0]
        self._h[j + 1] = futs.pop(2)
        self._after = futs[2:2 + L]
        self._ahead.append((j, sg.graph, futs[:2]))
        if self.store is not None:
            self._unstored[j] = (futs[2 + L:], sg, attempt)

    def _store_step(self, j: int) -> set:
        """Step j's store writes, once its rollout is done: wait for its trajectories (under the watch), mark the
        previous step complete (`_flush_complete`), reserve step j in the store and submit the writes with the
        attempt id the reserve returned (graphs.build_step_store). The driver's store bookkeeping (~40 ms of zarr
        calls, measured) so runs while the update holds one core and the other is free; before the graph went out
        it delayed every step, and beside the rollout it slowed the env workers on 2 cores. Returns the lost or
        stalled placed workers (empty: done, or nothing to do: no store, a failed trajectory whose error the step's
        own wait reports)."""
        if j not in self._unstored:
            return set()
        trajs, sg, attempt = self._unstored[j]
        lost = self._wait_or_lost(trajs)
        if lost or any(f.status != "finished" for f in trajs):
            return lost
        del self._unstored[j]
        self._flush_complete()
        store_attempt = self.store.reserve(j)
        g2, keys = graphs.build_step_store(run_id=self.state.run_id, step=j, attempt=attempt,
                                           store_path=str(self.store.path), trajs=trajs, store_attempt=store_attempt)
        i = next(i for i, (s, _, _) in enumerate(self._ahead) if s == j)
        futs = self._ahead[i][2] + self.client.get(g2, keys, sync=False)
        self._ahead[i] = (j, _merged(sg, g2), futs)
        return set()

    def _flush_complete(self) -> None:
        """Mark the newest finished step complete in the store (`_finish_step` defers it to the next step's store
        bookkeeping, `_store_step`, which runs during that step's update). Called there, and before anything that
        reads or changes the store's completeness or commits the run's progress: a checkpoint, a rollback, the
        run's end."""
        pending, self._pending_complete = getattr(self, "_pending_complete", None), None
        if pending is not None and self.store is not None:
            step, behaviour = pending
            self.store.mark_complete(step, weight_version=behaviour, global_step=step)

    def _update_trace(self, n: int) -> str | None:
        """Where training step n's update writes its torch profiler trace (`runner.profile_update_step`), else
        None."""
        if self.cfg.runner.profile_update_step != n:
            return None
        return str(self.run_dir / "profile" / f"update_step_{n}.json")

    def _cancel_pipeline(self) -> None:
        """Give up every step in flight, newest first and one graph at a time: a step's outputs go only after the
        later steps that depend on them (its update, its last env nodes) are gone. Released, not cancelled
        (recovery._drop: the scheduler's assertion on an inner node's dependents)."""
        for j, _, futs in reversed(self._ahead):
            self._drop(futs)
            self._drop(self._unstored.pop(j, ([],))[0])
            self._drop([h for h in (self._h.pop(j + 1, None),) if h is not None])
        self._ahead, self._after = [], None

    def _finish_step(self, step: int, upd_f, out: dict, store_out: list, retries: int, t0: float,
                     graph=None) -> dict:
        """Account a finished training step: weights, store step, cursors, counters, its perf event (`graph`: the
        step's graph); return its metrics. `t0`: when the step began, the earlier of its submission and the
        `train_step` call that waited for it (a step submitted ahead was submitted before that call).

        time/step is the step's own share of the wall: from its submission, or from the previous step's end when
        it was submitted while that one ran (steps ahead overlap; their time/step values add up to the wall, and
        rollout/env_steps_per_s is env steps over it)."""
        st = self.state
        version = int(out["metrics"]["train/weight_version"])
        if self.ranks > 1:  # the group lives on with the weights; a rebuild comes with a new init's weights
            self.actor_weights = {"version": version}
        if self.store is not None:  # marked complete in the next step's _store_step or at a commit point
            self._flush_complete()
            self._pending_complete = (step, int(out["metrics"].get("train/behaviour_version", version - 1)))
        self.weights = upd_f
        st.cursors = out["cursors"]
        env_steps = self._env_steps_per_step()
        st.env_steps += env_steps
        st.step += 1
        now = time.perf_counter()
        last = getattr(self, "_last_step_end", None)
        wall = now - (max(t0, last) if last is not None else t0)
        self._last_step_end = now
        m = out["metrics"]
        m["time/step"] = wall
        m["rollout/env_steps_per_s"] = env_steps / wall
        m["rollout/env_steps_total"] = float(st.env_steps)
        if self.cfg.runner.max_staleness == 0:  # asynchronous steps: the update overlaps the next rollout, no share
            m["time/overhead_share"] = max(0.0, 1.0 - (m["time/rollout_total_max"] + m["time/update"]) / wall)
        if store_out:
            m["time/store_max"] = max(s["seconds"] for s in store_out)
            m["system/store_mb"] = sum(s["bytes"] for s in store_out) / 1e6
        m["train/retries"] = float(retries)
        self._account_perf(graph, out, m, env_steps, retries)
        return m

    def _account_perf(self, graph, out: dict, m: dict, env_steps: int, attempt: int) -> None:
        """The step's perf event (pipelines.runner.perf) and `system/rss_total_gb`: the largest resident memory
        of the driver and every worker together at a step's end so far (GiB)."""
        if getattr(self, "perf", None) is None:
            return
        if graph is not None:
            self.perf.step(self.state.step, graph, out, m, env_steps=env_steps, attempt=attempt)
        self.peak_rss = max(self.peak_rss, self.perf.sample_memory())
        m["system/rss_total_gb"] = self.peak_rss / 2**30

    def sft_step(self) -> dict:
        """One behaviour-cloning step's graph (no env steps); lost workers are handled as for training steps."""
        st = self.state
        t0 = time.perf_counter()

        built = {}

        def build(attempt: int):
            graph, upd, met = graphs.build_sft_step(self.cfg, run_id=st.run_id, step=st.step, weights=self.weights,
                                                    placement=self.placement, attempt=attempt,
                                                    profile_trace=self._update_trace(st.step + 1))
            built.update(graph=graph, attempt=attempt)
            return graph, [upd, met]

        (upd_f,), (m,) = self._compute(build, "SFT step", keep=1)
        self.weights = upd_f
        st.step += 1
        m["time/step"] = time.perf_counter() - t0
        self._account_perf(built["graph"], {}, m, 0, built["attempt"])
        return m
