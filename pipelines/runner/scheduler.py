"""The step scheduler: one loop submits training-step graphs, waits for the oldest, retries after a loss.

Synchronous is asynchronous with `runner.max_staleness` = k = 0. The scheduler keeps up to k step graphs submitted
ahead of the one it waits for. Step j's rollout takes the weights of step j-k (`v(j-k)`: the rollout of step n+1
runs on v(n) while update n runs; the newest weights when nothing is in flight, so with k = 0 every rollout is
on-policy), its update the previous update's output, its first env nodes follow step j-1's last ones (only while
step j-1 is in flight: a drained pipeline needs no ordering); the actor corrects with decoupled PPO
(tasks.actor.entries.actor_update). Nothing is submitted ahead across a step after which an eval or a checkpoint
follows, nor beyond `max_steps`/`max_env_steps`: an eval or checkpoint always sees a drained pipeline, so a checkpoint holds
exactly what a synchronous one does (a resumed run refills the pipeline from v(n)). With k = 0 the graphs and keys
are those of one step at a time: `build_train_step(weights=v(j))`, keys `...-{run}-{j}` and `-retry{n}` for the n-th
resubmission of step j.

`Scheduler` is the runner's collaborator that owns the actor's weights across steps (the init graph, the weights
each step starts from, the multi-rank group) and the pipeline of step graphs in flight. It is given, explicitly,
the run's state, the watch (`pipelines.runner.watcher.Watcher`: every wait, the current placement), the run
context (the trajectory store, the run dir), the perf recorder and the recovery (`pipelines.runner.recovery`).

Failures (`retrying`, the one retry loop, also used by `compute` for the single graphs: eval, SFT, checkpoint):
a lost or stalled placed worker drops every graph in flight, the recovery re-places (and after a lost actor rolls
the run back to the last checkpoint, whose actor `init_actor` restores), and the pipeline refills from the current
step and weights, up to `runner.max_retries` times; then, or when no healthy placement is left, the cluster is gone
or the checkpoint graph itself fails, the run gives up with `RunStalled` (pipelines.runner.recovery: one line
`training step N: <what failed>; <what was saved>; <what to change>`, the checkpoint written when the actor's
workers are healthy). A non-finite value that stops a step inside a task
(tasks.actor.nonfinite.NonFiniteError, the env shard's one-line ValueError) ends the run with `StepFailed`, one line
naming the training step (numbered as MLflow's: the first step is 1).
"""
from __future__ import annotations

import time
from asyncio import CancelledError
from dataclasses import dataclass, field

from pipelines import graphs
from pipelines.clusters import host_of
from pipelines.runner.setup import learns_from_rollouts
from pipelines.runner.watcher import RunStalled, one_line
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
    running one of its rank nodes, see Watcher.plan_recovery)."""

    workers: set
    busy: set = field(default_factory=set)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _is_nonfinite(exc: BaseException) -> bool:
    from tasks.actor.nonfinite import NonFiniteError
    return isinstance(exc, NonFiniteError) or (isinstance(exc, ValueError) and str(exc).startswith("non-finite"))


class Scheduler:
    """The step scheduler (module docstring). `recovery`: pipelines.runner.recovery.Recovery (`recover`,
    `give_up`, `stopping`); `perf`: the PerfRecorder, or None."""

    def __init__(self, cfg, client, state, *, watch, ctx, recovery, perf=None):
        self.cfg, self.client, self.state = cfg, client, state
        self.watch, self.ctx, self.recovery, self.perf = watch, ctx, recovery, perf
        self.ranks = cfg.algorithm.num_actor_ranks  # 1 (tasks.actor.entries) or R > 1 (one process group)
        self.group: dict | None = None  # R > 1: {"master_addr", "master_port", "base_key"} of the current generation
        self.actor_weights = None  # what the ranks take as weights: the init's (to build from), then {"version"}
        self.weights = None  # a Future of the newest versioned weights (what rollouts and evals take)
        self.base_weights = None  # a Future of the init's full weights: the base of partial weights (tasks.weights)
        self.dims: tuple | None = None  # (obs_dim, action_dim), from the init graph
        self.stopping = False  # submit nothing more (the run is done; steps in flight drain)
        self.peak_rss = 0
        self._submits: dict[int, int] = {}  # step -> graphs submitted for it (retry keys stay unique)
        self._pending_complete: tuple[int, int] | None = None  # (store step, weight version) to mark complete
        self._last_step_end: float | None = None
        self._w: dict = {}
        self._h: dict = {}
        self.reset_pipeline()

    @property
    def placement(self):
        """The current placement (the watch's: a recovery replaces it)."""
        return self.watch.placement

    @property
    def store(self):
        return self.ctx.store

    @property
    def in_flight(self) -> int:
        """Training steps submitted and not yet accounted."""
        return len(self._ahead)

    # ----- the actor -----
    def init_actor(self, ckpt: str | None, tag: str = "") -> None:
        """Run the init graph (fresh, or from checkpoint path `ckpt`) and wait for the env dims under the watch:
        sets `weights` (a Future), `dims` and, with R > 1 ranks, `actor_weights` (what the ranks build their group
        from) and `group` (rank 0's host and a free port there).

        Raises:
            RunStalled: a placed worker was lost or stalled in the init graph (no retry path)."""
        init = graphs.build_init(self.cfg, run_id=self.state.run_id, placement=self.placement,
                                 checkpoint_path=ckpt, tag=tag)
        if self.ranks == 1:
            dims_f, w_f = self.client.get(init.graph, [init.dims, init.weights], sync=False)
            self.weights, self.dims = w_f, tuple(self._result([dims_f], "the init graph")[0])
            self.base_weights = w_f  # kept for the run: replicas load it once under partial updates
            return
        dims_f, w_f, full_f, port_f = self.client.get(
            init.graph, [init.dims, init.weights, init.actor_weights, init.port], sync=False)
        self.actor_weights = full_f
        dims, port = self._result([dims_f, port_f], "the init graph")
        # the init's rollout weights are the base of rank 0's partial weights (tasks.weights): kept for the
        # generation, their key in the group spec
        self.group = {"master_addr": host_of(self.placement.actor_workers[0]), "master_port": int(port),
                      "base_key": w_f.key}
        self.weights, self.dims, self.base_weights = w_f, tuple(dims), w_f

    def wait_init(self) -> float | None:
        """Wait (watched, nothing fetched) for the init graph's weights; returns the seconds waited (None: nothing
        to wait for). A worker lost meanwhile is left to the first step's retry."""
        futs = [f for f in (self.weights, self.actor_weights) if hasattr(f, "key")]
        if not futs:
            return None
        t0 = time.perf_counter()
        self.watch.wait_or_lost(futs)
        return time.perf_counter() - t0

    def _result(self, futures: list, what: str) -> list:
        """Results of `futures` under the watch, for waits without a retry path (the init graph).

        Raises:
            RunStalled: a placed worker was lost or stalled (the line was printed), with what to do next."""
        bad = self.watch.wait_or_lost(futures)
        results = bad if bad else self.watch.fetch_or_lost(futures)
        if isinstance(results, list):
            return results
        failed, fix = self.watch.failure(results)
        self.recovery.give_up(f"{what}: {failed}", fix, actor_healthy=False, unsaved="the actor is not initialised")

    def group_specs(self) -> list[dict] | None:
        """Each rank's process-group spec of the current generation (None with one rank)."""
        if self.ranks == 1:
            return None
        from tasks.actor.distributed import group_specs
        from tasks.weights import KeyName
        return group_specs(self.ranks, self.group["master_addr"], self.group["master_port"],
                           self.state.actor_generation, base_key=KeyName(self.group["base_key"]))

    # ----- the one retry loop -----
    def retrying(self, once, what: str):
        """`once(attempt)` until it returns something other than `Lost`; after a `Lost`, the recovery (`_recover`)
        and again, up to `runner.max_retries` retries (none while writing a give-up checkpoint).

        what: "training step" | "SFT step" (N of the give-up line: the step being run) or the name of a graph that
        follows step N ("evaluation", "checkpoint").

        Raises:
            RunStalled: every attempt lost or stalled workers (the checkpoint written when the actor's workers are
                healthy), the recovery found no healthy placement, or the cluster is gone (`Watcher.cluster_gone`).
        """
        stepping = what in ("training step", "SFT step")
        n = self.state.step + (1 if stepping else 0)
        prefix = "" if stepping else f"{what}: "
        R = 0 if self.recovery.stopping else self.cfg.runner.max_retries
        for attempt in range(R + 1):
            out = self._guarded(lambda: once(attempt), prefix, n)
            if not isinstance(out, Lost):
                return out
            if attempt < R:
                if self.perf is not None:
                    self.perf.retry(what, n)
                during = f"step {n}" if stepping else f"the {what} of step {n}"  # n: the step being run
                self._guarded(lambda: self._recover(out, during), prefix, n)
        failed, fix = self.watch.failure(out.workers, out.busy)
        ranks = set(self.placement.actor_workers[:self.ranks])
        self.recovery.give_up(f"{prefix}{failed}, on each of {R + 1} attempt(s) (runner.max_retries={R})",
                              f"{fix}, or raise runner.max_retries (now {R})",
                              actor_healthy=not (out.workers & ranks) and not out.busy, step=n)

    def _recover(self, out: Lost, during: str) -> None:
        """After a lost attempt: the recovery (pipelines.runner.recovery: re-placement, and after a lost actor the
        rollback of the run's records to the last checkpoint), then the actor restored from that checkpoint."""
        restore = self.recovery.recover(out.workers, self.state.step, out.busy, during=during)
        if restore is not None:
            self.init_actor(*restore)

    def _guarded(self, fn, prefix: str, n: int):
        """`fn()`; an error while the cluster is gone (`Watcher.cluster_gone`) becomes the give-up line, others
        pass."""
        try:
            return fn()
        except (RunStalled, StepFailed, ConfigError):
            raise
        except (Exception, CancelledError) as exc:  # a future cancelled by a lost scheduler is a CancelledError
            gone = self.watch.cluster_gone()
            if gone is None:
                raise
            self.recovery.give_up(f"{prefix}the cluster is gone: {gone} (the wait ended with "
                                  f"{type(exc).__name__}: {one_line(exc)})", "check the scheduler and its workers "
                                  "(cluster.address, or the embedded cluster's log)", actor_healthy=False, step=n,
                                  unsaved="the actor's weights were on the cluster")

    def _await(self, futs: list, keep: int) -> list | set:
        """The results of `futs[keep:]` once all of `futs` are done, or the lost/stalled placed workers (a set).
        Results are fetched under the same watch: a result held by a worker that dies after finishing would
        otherwise be recomputed from pinned tasks that can no longer run, and the fetch would wait forever."""
        lost = self.watch.wait_or_lost(futs)
        return lost if lost else self.watch.fetch_or_lost(futs[keep:])

    def compute(self, build, what: str, keep: int = 0) -> tuple[list, list]:
        """Submit `build(attempt) -> (graph, keys)`, wait and fetch under the watch, retrying after a loss
        (`_retrying`). Returns (the first `keep` keys as futures, the results of the others)."""
        def once(attempt: int):
            graph, keys = build(attempt)
            futs = self.client.get(graph, keys, sync=False)
            try:
                got = self._await(futs, keep)
            except (Exception, CancelledError) as exc:
                from tasks.actor.actor import ActorMissing
                if self.watch.cluster_gone() is not None or not (what == "checkpoint" or isinstance(exc, ActorMissing)):
                    raise
                self.watch.drop(futs)  # a checkpoint task failed (disk full, permissions), or the actor is gone: no
                # retry
                if isinstance(exc, ActorMissing):  # the actor's worker was restarted (a checkpoint, or an eval of
                    # its averaged weights, reads the resident actor): not a disk problem
                    self.recovery.give_up(f"{what}: the actor of step {self.state.step} is gone from its worker "
                                          f"(the worker process was restarted: {one_line(exc)})",
                                          "resume from the last checkpoint; if workers were killed from outside (a "
                                          "signal to the driver alone stops the run gracefully), find what killed "
                                          "them", actor_healthy=False, step=self.state.step,
                                          unsaved="the actor's state was lost")
                self.recovery.give_up(f"checkpoint: writing the checkpoint of step {self.state.step} under "
                                      f"{self.ctx.run_dir} failed ({type(exc).__name__}: {one_line(exc)})",
                                      f"check that run_root ({self.cfg.run_root}) is writable and has free space",
                                      actor_healthy=False, step=self.state.step, unsaved="writing it is what failed")
            if isinstance(got, list):
                return futs[:keep], got
            busy = self.watch.busy_rank_workers(graph)  # before dropping: dropped tasks leave the scheduler's view
            self.watch.drop(futs)  # recovery: release, not cancel (see there)
            return Lost(got, busy)

        return self.retrying(once, what)

    # ----- training steps -----
    def train_step(self) -> dict:
        """Wait for the oldest step in flight, after topping the pipeline up to `max_staleness` steps ahead; on a
        lost worker, recover and retry (up to `runner.max_retries`). Returns the step's metrics.

        Raises:
            StepFailed: a non-finite value stopped the step (one line naming it).
        """
        if not learns_from_rollouts(self.cfg):
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
                self.cancel_pipeline()
                raise StepFailed(f"training step {step + 1}: {_one_line(exc)}") from exc
            futs = self._ahead[0][2]
            if isinstance(got, set):
                busy = set().union(*(self.watch.busy_rank_workers(g) for _, g, _ in self._ahead))
                self.cancel_pipeline()  # every step in flight: the retry starts from the current step
                return Lost(got, busy)
            _, graph, _ = self._ahead.pop(0)
            for old in [v for v in self._w if v < step + 1 - k]:  # weights no later rollout takes
                del self._w[old]
                self._h.pop(old, None)
            out, *store_out = got
            start = min(t0, self._submitted_at.pop(step, t0))  # a step submitted ahead began before this call
            return self._finish_step(step, futs[0], out, store_out, attempt, start, graph)

        return self.retrying(once, "training step")

    def reset_pipeline(self) -> None:
        """Start the pipeline afresh from `self.weights` at the current step (`_submit_step` with nothing in flight)."""
        self._ahead: list[tuple[int, object, list]] = []  # submitted steps (step, graph, futures), oldest first
        j, w, h = self.state.step, self._w, self._h
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
        return (not self.stopping and j < r.max_steps and j % r.val_check_interval != 0
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
            self.reset_pipeline()  # pipeline from the current step and weights, whoever changed them
        j = st.step + len(self._ahead)
        attempt = self._submits.get(j, 0)  # keys unique per resubmission of step j (released keys may linger)
        self._submits[j] = attempt + 1
        ahead = bool(self._ahead)
        # with nothing in flight the newest weights cost no waiting: a drained pipeline restarts on-policy
        v = max(j - cfg.runner.max_staleness, self._w_base) if ahead else j
        behaviour = self._w[v]
        sg = graphs.build_train_step(
            cfg, run_id=st.run_id, step=j, weights=behaviour, cursors=st.cursors, placement=self.placement,
            dims=self.dims, store_path=None, attempt=attempt, group=self.group_specs(),
            actor_weights=self.actor_weights, update_weights=self._w[j] if ahead else None,
            after=self._after if ahead else None, profile_trace=self.update_trace(j + 1),
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
        previous step complete (`flush_complete`), reserve step j in the store and submit the writes with the
        attempt id the reserve returned (graphs.build_step_store). The driver's store bookkeeping (~40 ms of zarr
        calls, measured) so runs while the update holds one core and the other is free; before the graph went out
        it delayed every step, and beside the rollout it slowed the env workers on 2 cores. Returns the lost or
        stalled placed workers (empty: done, or nothing to do: no store, a failed trajectory whose error the step's
        own wait reports)."""
        if j not in self._unstored:
            return set()
        trajs, sg, attempt = self._unstored[j]
        lost = self.watch.wait_or_lost(trajs)
        if lost or any(f.status != "finished" for f in trajs):
            return lost
        del self._unstored[j]
        self.flush_complete()
        store_attempt = self.store.reserve(j)
        g2, keys = graphs.build_step_store(run_id=self.state.run_id, step=j, attempt=attempt,
                                           store_path=str(self.store.path), trajs=trajs, store_attempt=store_attempt)
        i = next(i for i, (s, _, _) in enumerate(self._ahead) if s == j)
        futs = self._ahead[i][2] + self.client.get(g2, keys, sync=False)
        self._ahead[i] = (j, _merged(sg, g2), futs)
        return set()

    def flush_complete(self) -> None:
        """Mark the newest finished step complete in the store (`_finish_step` defers it to the next step's store
        bookkeeping, `_store_step`, which runs during that step's update). Called there, and before anything that
        reads or changes the store's completeness or commits the run's progress: a checkpoint, a rollback, the
        run's end."""
        pending, self._pending_complete = self._pending_complete, None
        if pending is not None and self.store is not None:
            step, behaviour = pending
            self.store.mark_complete(step, weight_version=behaviour, global_step=step)

    def update_trace(self, n: int) -> str | None:
        """Where training step n's update writes its torch profiler trace (`runner.profile_update_step`), else
        None."""
        if self.cfg.runner.profile_update_step != n:
            return None
        return str(self.ctx.run_dir / "profile" / f"update_step_{n}.json")

    def cancel_pipeline(self) -> None:
        """Give up every step in flight, newest first and one graph at a time: a step's outputs go only after the
        later steps that depend on them (its update, its last env nodes) are gone. Released, not cancelled
        (recovery._drop: the scheduler's assertion on an inner node's dependents)."""
        for j, _, futs in reversed(self._ahead):
            self.watch.drop(futs)
            self.watch.drop(self._unstored.pop(j, ([],))[0])
            self.watch.drop([h for h in (self._h.pop(j + 1, None),) if h is not None])
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
            self.flush_complete()
            self._pending_complete = (step, int(out["metrics"].get("train/behaviour_version", version - 1)))
        self.weights = upd_f
        st.cursors = out["cursors"]
        env_steps = self._env_steps_per_step()
        st.env_steps += env_steps
        st.step += 1
        now = time.perf_counter()
        last = self._last_step_end
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
        if self.perf is None:
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
                                                    profile_trace=self.update_trace(st.step + 1))
            built.update(graph=graph, attempt=attempt)
            return graph, [upd, met]

        (upd_f,), (m,) = self.compute(build, "SFT step", keep=1)
        self.weights = upd_f
        st.step += 1
        m["time/step"] = time.perf_counter() - t0
        self._account_perf(built["graph"], {}, m, 0, built["attempt"])
        return m
