"""The training loop of one run: a short driver (step / eval / checkpoint cadence) over explicit collaborators.

- `RunContext` (pipelines.runner.context): the run dir and its lock, the MLflow run, the trajectory store, the
  RunState and the one timeline on disk;
- `Watcher` (pipelines.runner.watcher): every wait on the cluster, the current placement, and the recovery
  decision after lost or stalled workers;
- `Recovery` (pipelines.runner.recovery): what the run does with that decision: retry, roll back, or give up with
  one line;
- `Scheduler` (pipelines.runner.scheduler): the actor's weights and the pipeline of step graphs (synchronous is
  asynchronous with `runner.max_staleness=0`), and the one retry loop;
- `Evaluator` (pipelines.runner.evals): the eval graphs and the run's eval decisions (tasks.evalstats);
- `PerfRecorder` (pipelines.runner.perf): the perf events of each step, eval and checkpoint, and the
  `perf_summary.json` (time per phase from Dask's task stream, throughput, peak memory, retries) at the end.

Only this package and pipelines.run hold a Dask client. Per step (`Runner.run`): the scheduler builds and submits the
step graph, then, once its trajectories are done (during the update, when one core is free), marks the previous step
complete in the store, reserves this one's store step and submits its store writes; it waits for `step_metrics` and
the store writes (a step's mark comes in the next step's bookkeeping, or before a checkpoint, a rollback and the run's
end); the driver evaluates every `val_check_interval` steps, logs one MLflow batch (before the checkpoint: the MLflow
run a checkpoint records holds every point through its step, which is what a resume copies), checkpoints every
`save_interval` steps and at every eval that sets a new best (marked `checkpoints/best`, never pruned; with
`env.eval.val_episodes` > 0 the best on a validation split of other episodes) and advances the progress bar. A
run stopped by `max_wall_time_s` finishes the steps already in flight.

Resume and interruption: a resume (`runner.resume=RUN_ID|latest`: the most recently started run of the experiment,
an error naming it when it has no checkpoint) restores the RunState from the newest checkpoint; with the cursors
(open episodes, per-shard RNG), the actor's weights, optimizer and process RNG in the checkpoint, the resumed run
continues exactly what was saved. Not saved, and not savable: the state an env instance carries from its earlier
episodes (`tasks.envs.carries_history`: a ManiSkill CPU env's solver and contact state), which a freshly built env
lacks; so a resumed run can leave the uninterrupted one's trajectory once contacts differ (benchmarks/env_history.py;
README "Resume"), unless `runner.exact_resume`: then every checkpoint is followed by re-creating the env and eval
shards from the saved cursors (`_fresh_envs`), so the uninterrupted run and a resume from that checkpoint step the
same freshly built envs. `request_stop` (pipelines.run: the first SIGINT/SIGTERM) ends the loop after the step(s) in
flight with a checkpoint of the current step.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from pipelines import graphs
from pipelines.clusters import ClusterHandle, plan_placement
from pipelines.runner.context import RunContext
from pipelines.runner.evals import Evaluator
from pipelines.runner.perf import PerfRecorder, format_table, write_summary
from pipelines.runner.recovery import Recovery
from pipelines.runner.scheduler import Scheduler
from pipelines.runner.setup import RunResult, resolve_resume
from pipelines.runner.watcher import Watcher
from storage.checkpoints import mark_best, prune_checkpoints
from storage.rundir import RunDirGone, make_dir_in
from tasks.config import Config
from tasks.envs import carries_history


class Runner:
    """Drives one experiment on a connected cluster. `run()` returns a RunResult.

    Raises (from the constructor): tasks.config.ConfigError for a resume that cannot be honoured
    (`resolve_resume`) or a run dir another live driver owns (`RunContext.hold`), before anything is written.
    `run_lock`: the run dir's lock when the caller took it already (pipelines.run); else the Runner takes it and
    releases it when `run()` ends."""

    def __init__(self, cfg: Config, handle: ClusterHandle, *, echo=print, run_lock=None):
        self.cfg, self.handle, self.client, self.echo = cfg, handle, handle.client, self._bar_safe(echo)
        self._bar = None  # the progress bar while run() goes (a rollback sets it back: `_rollback`)
        say = self._say  # the collaborators print through the runner's `echo`, whatever it is when they print
        ranks = cfg.algorithm.num_actor_ranks
        self.watch = Watcher(cfg, self.client, plan_placement(cfg, self.client), ranks=ranks, echo=say)
        res = resolve_resume(cfg)  # refuses a bad resume before writing anything
        if res.checkpoint is not None:
            self.echo(f"resuming run {res.state.run_id} from {res.checkpoint} (step {res.state.step})")
            if res.state.step >= cfg.runner.max_steps:
                self.echo(f"the checkpoint is at runner.max_steps={cfg.runner.max_steps} already: no training "
                          f"step; only the final eval and checkpoint run again (raise runner.max_steps to train on)")
        self.state = st = res.state
        self.ctx = RunContext(cfg, st, echo=say)
        self.ctx.hold(run_lock)  # one live driver per run dir (and sft.store not re-recorded): before any write
        if res.checkpoint is not None and ranks > 1:  # a resumed run: drop groups a previous driver left
            self.watch.release_groups(self.placement.actor_workers[:ranks], st.run_id, st.actor_generation)
            st.actor_generation += 1
        self.ctx.open()
        try:  # an interrupt or error while setting up must not leave the MLflow run RUNNING
            self.perf = PerfRecorder(self.client, self.run_dir, st.run_id, roles=self._roles,
                                     colocated=cfg.rollout.inference == "colocated",
                                     samples_per_step=cfg.batch_size, sft_batch_size=cfg.sft.batch_size)
            self.recovery = Recovery(cfg, st, watch=self.watch, ctx=self.ctx, checkpoint=self.checkpoint,
                                     rollback=self._rollback, echo=say, jobs=getattr(handle, "lost_jobs", None))
            self.sched = Scheduler(cfg, self.client, st, watch=self.watch, ctx=self.ctx, recovery=self.recovery,
                                   perf=self.perf)
            self.evals = Evaluator(cfg, st, ctx=self.ctx, sched=self.sched, perf=self.perf, echo=say)
            self.ctx.log_run(res)
            self.sched.init_actor(None if res.checkpoint is None else str(res.checkpoint),
                                  tag=f"g{st.actor_generation}" if ranks > 1 else "")
            self.ctx.open_store(self.sched.dims)
            self.stop_requested: str | None = None  # request_stop(): end after the step in flight, checkpointed
            self.after_step = None  # optional hook(runner) called after each step is accounted (tests, tools)
            self._last_ckpt = None
        except BaseException as exc:
            self.tracker.set_terminated("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            self.ctx.release()
            raise

    # ----- what callers read (pipelines.run, tests, tools) -----
    run_dir = property(lambda self: self.ctx.run_dir)
    tracker = property(lambda self: self.ctx.tracker)
    tracking_uri = property(lambda self: self.ctx.tracking_uri)
    store = property(lambda self: self.ctx.store)
    placement = property(lambda self: self.watch.placement)
    weights = property(lambda self: self.sched.weights)
    last_eval = property(lambda self: self.evals.last)

    # ----- the loop -----
    def run(self) -> RunResult:
        """Train until `_done`: eval at start, then per step train, eval, log, checkpoint; a final eval and
        checkpoint (none of the eval when stopped early). Sets the MLflow run FINISHED / KILLED / FAILED. Ends with
        the perf report (`_report`: perf_summary.json in the run dir and in MLflow, the table printed), also when
        nothing was left to do (a resume of a finished run). `RunResult.peak_rss_gb`: the sum of every process's
        peak resident memory (driver, scheduler, workers; pipelines.runner.perf).

        Raises:
            storage.rundir.RunDirGone: the run directory, its trajectory store or its local MLflow store was removed
                (or replaced) while the run trained, whatever failed first because of it (`RunContext.files_gone`:
                one line; nothing more is written there, nothing re-created)."""
        st, ctx, sched = self.state, self.ctx, self.sched
        t_start = time.perf_counter()
        self.perf.session_start()
        bar = self._bar = self._progress_bar()
        self._last_ckpt = None
        status = "FAILED"
        ended = False
        try:
            waited = sched.wait_init()  # the first step's wall holds the first step only
            if waited is not None:
                self.perf.phase("init", st.step, waited)
            self._eval_at_start(t_start)
            while True:
                gone = ctx.files_gone()
                if gone is not None:  # a step writes nothing that would show it (no store)
                    raise RunDirGone(gone)
                sched.stopping = self._done(t_start)
                if sched.stopping and not sched.in_flight:  # steps in flight when the run is done still finish
                    break
                with self._profiled(st.step + 1):
                    m = self.train_step()
                self._account_step(m, t_start, bar)
            status = self._finish_run(t_start)
            ended = True
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        except Exception:
            gone = ctx.files_gone()
            if gone is not None:  # whatever failed first (a store read, a checkpoint task, an eval record, an MLflow
                raise RunDirGone(gone) from None  # write) did so because the run's files vanished: the one line
            raise
        finally:
            gone = ctx.files_gone() is not None
            if not gone:  # else nothing more is written (the store mark and the perf summary would re-create
                self._flush_complete_at_end()  # parts of a removed run dir; a vanished MLflow store takes nothing)
            if bar is not None:
                bar.close()
            self._bar = None
            if not gone:
                self._report(live=ended)
            if self.tracker.store_gone() is None:
                self.tracker.set_terminated(status)
            ctx.release()  # the run dir's lock (RunContext.hold): its last write is done
        return RunResult(st.run_id, self.run_dir, self.tracker.run_id, self.tracking_uri,
                         self.store.path if self.store is not None else None, st.step, st.env_steps,
                         time.perf_counter() - t_start, self.last_eval, self.perf.cluster_peak_bytes() / 2**30,
                         interrupted=self.stop_requested)

    def train_step(self) -> dict:
        """One training step (Scheduler.train_step: the oldest step in flight, the pipeline topped up); returns its
        metrics. Raises StepFailed (pipelines.runner.scheduler) for a non-finite value."""
        return self.sched.train_step()

    def evaluate(self, echo: bool = True, last: bool = False) -> dict:
        """The eval at the current step (Evaluator.evaluate); returns its `eval/*` (and `val/*`) metrics."""
        return self.evals.evaluate(echo=echo, last=last)

    def _flush_complete_at_end(self) -> None:
        """The last finished step's store mark (Scheduler.flush_complete) when the loop ends, also by an error or an
        interrupt: its shards were all written, so it is shown; a failure to mark it is printed, not raised over
        the error that ended the run."""
        try:
            self.sched.flush_complete()
        except Exception as exc:  # noqa: BLE001 - the run is ending; the step stays unshown, which is safe
            self.echo(f"dagrl: could not mark the last finished step complete in {self.store.path}: "
                      f"{type(exc).__name__}: {exc}")

    def _roles(self) -> dict[str, str]:
        """Worker address -> its role in the current placement ("env_workers", "gpu_workers")."""
        p = self.placement
        return {**{a: "env_workers" for a in p.env_workers}, **{a: "gpu_workers" for a in p.gpu_workers}}

    def _report(self, live: bool) -> None:
        """The perf report at the end of `run()` (pipelines.runner.perf): a last memory sample, the session's end,
        `<run dir>/perf_summary.json` logged to MLflow and the table printed. Not `live` (the loop raised): the
        summary is written from what was recorded, without reading the cluster (it may be gone) and without the
        table. Never raises: a report that fails is one line."""
        try:
            if live:
                self.perf.sample_memory(exact=True)
            self.perf.session_end(read_cluster=live)
            path, summary = write_summary(self.run_dir)
            self.tracker.log_artifact(path)
            if live:
                self.echo(format_table(summary))
        except Exception as exc:  # noqa: BLE001 - the run's outcome stands without its report
            self.echo(f"dagrl: the perf summary was not written: {type(exc).__name__}: {exc}")

    @contextmanager
    def _profiled(self, n: int):
        """Training step n under `distributed.performance_report` when it is in `runner.profile_steps`: the HTML
        report `<run dir>/profile/step_<n>.html`, logged to MLflow under profile/; then the update's torch trace
        (`runner.profile_update_step`, tasks.profiling) when step n wrote one. A step that raises leaves its
        report unwritten (closing it would query a cluster that may be gone)."""
        if n in self.cfg.runner.profile_steps:
            from distributed import performance_report
            path = make_dir_in(self.run_dir, "profile") / f"step_{n}.html"
            report = performance_report(filename=str(path))
            with self.client.as_current():
                report.__enter__()
            yield
            with self.client.as_current():
                report.__exit__(None, None, None)
            self.tracker.log_artifact(path, "profile")
        else:
            yield
        trace = self.sched.update_trace(n)
        if trace is not None and Path(trace).is_file():
            self.tracker.log_artifact(trace, "profile")

    def _say(self, *args, **kw):
        return self.echo(*args, **kw)

    def _bar_safe(self, echo):
        """`echo` that clears the progress bar (while one is up) before printing and redraws it after
        (tqdm.external_write_mode): a line printed during a step (a lost worker, a stop, an eval) was glued to
        the bar's line ("...success=0.00]dagrl: worker(s) ... lost during step 2")."""
        def say(*args, **kw):
            if getattr(self, "_bar", None) is None:
                return echo(*args, **kw)
            from tqdm import tqdm
            with tqdm.external_write_mode():
                return echo(*args, **kw)
        return say

    def _progress_bar(self):
        if not self.cfg.runner.progress:
            return None
        from tqdm import tqdm
        return tqdm(total=self.cfg.runner.max_steps, initial=self.state.step, desc=self.cfg.experiment, unit="step",
                    dynamic_ncols=True)

    # ----- the cadence -----
    def _eval_at_start(self, t_start: float) -> None:
        if self.cfg.runner.val_at_start and self.state.step == 0 and not self.ctx.eval_logged(0):
            self.tracker.log_metrics(self.evaluate(echo=False), step=0)
            self.echo(f"dagrl: eval before training: {self.evals.text()}")
            if self.ctx.best_unmarked():  # the starting policy is the best so far: a checkpoint of step 0 holds it
                self._last_ckpt = self.checkpoint(self.state.elapsed_s + time.perf_counter() - t_start)

    def _account_step(self, m: dict, t_start: float, bar) -> None:
        """After a training step: eval (every val_check_interval), log, checkpoint (every save_interval, and at a new
        best eval), bar (at the run's step), hook."""
        st, r = self.state, self.cfg.runner
        if st.step % r.val_check_interval == 0:
            m.update(self.evaluate(last=self._done(t_start)))  # the run's last eval also films (films_eval)
        self.tracker.log_metrics(m, step=st.step)  # before the checkpoint (module docstring)
        if st.step % r.save_interval == 0 or self.ctx.best_unmarked():  # a new best eval is checkpointed too
            self._last_ckpt = self.checkpoint(st.elapsed_s + time.perf_counter() - t_start)
        if bar is not None:
            bar.n = st.step  # the run's step, also after a rollback (`_rollback` sets it back at once)
            bar.set_postfix(progress_postfix(m, self.last_eval))
        if self.after_step is not None:
            self.after_step(self)

    def _finish_run(self, t_start: float) -> str:
        """The final eval (not when stopped early, nor when the kept timeline has it) and checkpoint; returns the
        MLflow status."""
        st, cfg = self.state, self.cfg
        stopped = self.stop_requested
        if stopped is None and (not self.last_eval or st.step % cfg.runner.val_check_interval) \
                and not self.ctx.eval_logged(st.step):  # a resume at the end: the kept timeline has it
            self.tracker.log_metrics(self.evaluate(last=True), step=st.step)
        elapsed = st.elapsed_s + time.perf_counter() - t_start
        if self._last_ckpt is None or st.step % cfg.runner.save_interval or self.ctx.best_unmarked():
            self._last_ckpt = self.checkpoint(elapsed)
        if stopped is not None:
            self.echo(f"dagrl: stopped ({stopped}) after step {st.step}: checkpoint {self._last_ckpt}; continue "
                      f"with runner.resume={st.run_id} (or runner.resume=latest)")
            return "KILLED"
        self.tracker.log_text(str(self._last_ckpt), "final_checkpoint.txt")
        self.tracker.log_artifact(Path(self._last_ckpt), "final_checkpoint")
        return "FINISHED"

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask the loop to stop cleanly: the step in flight (all steps in flight, asynchronous) finishes, an eval or
        checkpoint under way completes, then a checkpoint of the current step is written, the MLflow run is set
        KILLED and `run()` returns a RunResult with `interrupted=reason`. Safe to call from a signal handler (it
        only sets a flag); pipelines.run calls it on the first SIGINT/SIGTERM."""
        self.stop_requested = reason

    def _done(self, t_start: float) -> bool:
        r, s = self.cfg.runner, self.state
        if self.stop_requested is not None:
            return True
        if s.step >= r.max_steps:
            return True
        if r.max_env_steps is not None and s.env_steps >= r.max_env_steps:
            return True
        if r.max_wall_time_s is not None and s.elapsed_s + (time.perf_counter() - t_start) >= r.max_wall_time_s:
            return True
        if r.stop_on_eval_success is not None and self.ctx.best()[1] >= r.stop_on_eval_success:
            return True
        return False

    # ----- checkpoints and rollbacks -----
    def checkpoint(self, elapsed: float) -> str:
        """Write a checkpoint of the current step (the pipeline must be drained); returns its path. Marks it
        `checkpoints/best` when the best eval is at this step, prunes old ones (never the best) and, with
        `runner.exact_resume` and an env that carries history (`tasks.envs.carries_history`), re-creates the envs
        (`_fresh_envs`).

        Raises:
            RuntimeError: steps are in flight (the actor would be read while a later update may run)."""
        from dataclasses import asdict
        st, sched = self.state, self.sched
        t0 = time.perf_counter()
        if sched.in_flight:  # the actor would be read while a later update may run (scheduler docstring)
            raise RuntimeError(f"checkpoint at step {st.step} with {sched.in_flight} step(s) in flight")
        sched.flush_complete()  # every step the checkpoint covers is complete in the store before it is written

        def build(attempt: int):
            meta = {"runner": {**asdict(st), "elapsed_s": elapsed}, "experiment": self.cfg.experiment}
            graph, key = graphs.build_checkpoint(run_id=st.run_id, step=st.step, run_dir=str(self.run_dir),
                                                 meta=meta, placement=self.placement, attempt=attempt, cfg=self.cfg,
                                                 group=sched.group_specs(), weights=sched.actor_weights,
                                                 dims=sched.dims)
            return graph, [key]

        path = sched.compute(build, "checkpoint")[1][0]
        best_step, best_value, metric = self.ctx.best()
        if best_step == st.step:  # written after the eval that set it: this checkpoint holds the best
            mark_best(self.run_dir, st.step, best_value, metric)
        prune_checkpoints(self.run_dir, self.cfg.runner.keep_checkpoints)  # never the best
        if self.cfg.runner.exact_resume and carries_history(self.cfg.env):  # fresh envs, as a resumed run's
            self._fresh_envs()
        self.perf.phase("checkpoint", st.step, time.perf_counter() - t0)
        return path

    def _fresh_envs(self) -> None:
        """runner.exact_resume: drop the run's env shards and eval shards on every worker; the next step and eval
        re-create them from the cursors the checkpoint just saved (tasks.rollout.get_shard), the path a resume takes,
        so the uninterrupted run and a resume from this checkpoint step the same freshly built envs."""
        from tasks import resident
        for part in ("shard", "eval"):
            self.watch.run_on(resident.release, f"{self.state.run_id}/{part}/", what=f"releasing the {part} envs")

    def _rollback(self, ckpt) -> None:
        """Roll the run back to checkpoint `ckpt` (a path; None: a fresh start at step 0), e.g. after the actor's
        worker was lost: the last finished step marked complete first, then the records (RunContext.restore: state,
        store, MLflow, eval records, best pointer), the progress bar and the perf events. The actor itself is not
        touched: the caller restores it from the same checkpoint (Scheduler.init_actor)."""
        st = self.state
        self.sched.flush_complete()  # a step finished before the loss is marked first, then invalidated if rolled back
        self.ctx.restore(ckpt)
        if self._bar is not None:  # the progress bar follows the run back
            self._bar.n = st.step
            self._bar.refresh()
        self.perf.rollback(st.step)
        self.echo(f"dagrl: rolled back to {ckpt or 'a fresh actor (no checkpoint yet)'} (step {st.step}); MLflow "
                  f"continues in run {st.mlflow_run_id}")

    def rollback_to(self, ckpt, tag: str) -> None:
        """Roll the run back to checkpoint `ckpt` (`_rollback`) and restore the actor from it (the path a lost
        actor's recovery takes, without the re-placement); `tag`: the init graph's key tag."""
        self._rollback(ckpt)
        self.sched.init_actor(None if ckpt is None else str(ckpt), tag=tag)


def progress_postfix(m: dict, last_eval: dict | None) -> dict[str, str]:
    """The progress bar's fields after a step with metrics `m`: an RL step's env steps/s and the success rate of the
    training episodes that ended in it (`env/success_once`; `-` when none ended: a step shorter than an episode,
    the smoke run's), an SFT step's loss; then the last eval's success_once (`last_eval`'s), when there is one."""
    import math
    if "rollout/env_steps_per_s" in m:
        done = m.get("env/success_once", float("nan"))
        post = {"env_sps": f"{m['rollout/env_steps_per_s']:.0f}",
                "success": f"{done:.2f}" if math.isfinite(done) else "-"}
    else:
        post = {"loss": f"{m['train/sft_loss']:.3f}"}
    if last_eval:
        post["eval"] = f"{last_eval['eval/success_once']:.2f}"
    return post
