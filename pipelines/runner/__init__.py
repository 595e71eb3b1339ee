"""The training loop of one run, a short driver over three parts:

- `pipelines.runner.setup`: run id and dir, the MLflow run, resume (`resolve_resume`, offline), the trajectory
  store, the actor's init graph, and the one-timeline rollback;
- `pipelines.runner.scheduler`: the step scheduler, one loop in which synchronous is asynchronous with
  `runner.max_staleness=0`, and the one retry loop;
- `pipelines.runner.recovery`: the watch over the placed workers (lost, paused, stuck, silent) and `_recover`;
- `pipelines.runner.perf`: the perf events of each step, eval and checkpoint, and the `perf_summary.json` (time
  per phase from Dask's task stream, throughput, every process's peak memory, retries) written at the end.

Only this package and pipelines.run hold a Dask client. Per step (`Runner.run`): the scheduler builds and submits the
step graph, then, once its trajectories are done (during the update, when one core is free), marks the previous step
complete in the store, reserves this one's store step and submits its store writes; it waits for `step_metrics` and
the store writes (a step's mark comes in the next step's bookkeeping, or before a checkpoint, a rollback and the run's
end); the driver evaluates every `val_check_interval` steps, logs one MLflow batch (before the checkpoint: the MLflow
run a checkpoint records holds every point through its step, which is what a resume copies), checkpoints every
`save_interval` steps and at every eval that sets a new best (marked `checkpoints/best`, never pruned; `evaluate`;
with `env.eval.val_episodes` > 0 the best on a validation split of other episodes) and advances the progress bar. A
run stopped by `max_wall_time_s` finishes the steps already in flight.

Resume and interruption: a resume (`runner.resume=RUN_ID|latest`: the most recently started run of the experiment,
an error naming it when it has no checkpoint) restores the RunState from the newest checkpoint; with the cursors
(open episodes, per-shard RNG), the actor's weights, optimizer and process RNG in the checkpoint, the resumed run
continues exactly what was saved. Not saved, and not savable: a ManiSkill CPU env's solver and contact state from
its earlier episodes, which a freshly built env lacks; so a resumed run can leave the uninterrupted one's trajectory
once contacts differ (benchmarks/env_history.py; README "Resume"), unless `runner.exact_resume`: then every
checkpoint is followed by re-creating the env and eval shards from the saved cursors (`_fresh_envs`), so the
uninterrupted run and a resume from that checkpoint step the same freshly built envs. `request_stop`
(pipelines.run: the first SIGINT/SIGTERM) ends the loop after the step(s) in flight with a checkpoint of the
current step.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pipelines import graphs
from pipelines.cluster import ClusterHandle, Placement, plan_placement
from pipelines.runner.perf import PerfRecorder, format_table, write_summary
from pipelines.runner.recovery import Recovery
from pipelines.runner.scheduler import Scheduler, StepFailed
from pipelines.runner.setup import (Resume, RunResult, RunState, Setup, new_run_id, resolve_resume, run_params,
                                    trajectory_fields)
from storage.checkpoints import mark_best, prune_checkpoints, read_best
from storage.rundir import RunDirGone, make_dir_in, run_dir_gone
from tasks import evalstats
from tasks.config import Config

__all__ = ["Runner", "RunResult", "RunState", "Resume", "StepFailed", "new_run_id", "resolve_resume",
           "run_params", "trajectory_fields"]


class Runner(Scheduler, Setup, Recovery):
    """Drives one experiment on a connected cluster. `run()` returns a RunResult.

    Raises (from the constructor): tasks.config.ConfigError for a resume that cannot be honoured
    (`resolve_resume`) or a run dir another live driver owns (`Setup._hold_run_dir`), before anything is written.
    `run_lock`: the run dir's lock when the caller took it already (pipelines.run); else the Runner takes it and
    releases it when `run()` ends."""

    def __init__(self, cfg: Config, handle: ClusterHandle, *, echo=print, run_lock=None):
        self.cfg, self.handle, self.client, self.echo = cfg, handle, handle.client, self._bar_safe(echo)
        self.root = Path(cfg.run_root).resolve()
        self.placement: Placement = plan_placement(cfg, self.client)
        self._placed_ids = self._placed_worker_ids()
        self.state, ckpt, resume = self._start_or_resume()  # refuses a bad resume before writing anything
        self._hold_run_dir(run_lock)  # one live driver per run dir (and sft.store not re-recorded): before any write
        self.group: dict | None = None  # multi-rank actor: {"master_addr", "master_port"} of the current generation
        self.actor_weights = None  # what the ranks take as weights: the init's (to build from), then {"version"}
        if ckpt is not None and self.ranks > 1:  # a resumed run: drop groups a previous driver left on the workers
            self._release_groups(self.placement.actor_workers[:self.ranks])
            self.state.actor_generation += 1
        self._open_run()
        try:  # an interrupt or error while setting up must not leave the MLflow run RUNNING
            self.peak_rss = 0
            self.perf = PerfRecorder(self.client, self.run_dir, self.state.run_id, roles=self._roles,
                                     colocated=cfg.rollout.inference == "colocated",
                                     samples_per_step=cfg.batch_size)
            self._log_run(resume)
            self.weights, dims = self._init_actor(
                ckpt, tag=f"g{self.state.actor_generation}" if self.ranks > 1 else "")
            self.dims = tuple(dims)
            self.store = self._open_store(self.dims)
            self._bar = None  # the progress bar while run() goes (a rollback sets it back: Setup._rollback)
            self.last_eval: dict = {}
            self._stopping = False  # submit nothing more (the run is done; steps in flight drain)
            self._submits: dict[int, int] = {}  # step -> graphs submitted for it (retry keys stay unique)
            self._pending_complete: tuple[int, int] | None = None  # (store step, weight version) to mark complete
            self.stop_requested: str | None = None  # request_stop(): end after the step in flight, checkpointed
            self.after_step = None  # optional hook(runner) called after each step is accounted (tests, tools)
            self._reset_pipeline()
        except BaseException as exc:
            self.tracker.set_terminated("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            self._release_run_dir()
            raise

    # ----- the loop -----
    def run(self) -> RunResult:
        """Train until `_done`: eval at start, then per step train, eval, log, checkpoint; a final eval and
        checkpoint (none of the eval when stopped early). Sets the MLflow run FINISHED / KILLED / FAILED. Ends with
        the perf report (`_report`: perf_summary.json in the run dir and in MLflow, the table printed), also when
        nothing was left to do (a resume of a finished run). `RunResult.peak_rss_gb`: the sum of every process's
        peak resident memory (driver, scheduler, workers; pipelines.runner.perf).

        Raises:
            storage.rundir.RunDirGone: the run directory, its trajectory store or its local MLflow store was removed
                (or replaced) while the run trained, whatever failed first because of it (`_files_gone`: one line;
                nothing more is written there, nothing re-created)."""
        st = self.state
        t_start = time.perf_counter()
        self.perf.session_start()
        bar = self._bar = self._progress_bar()
        self._last_ckpt = None
        status = "FAILED"
        ended = False
        try:
            self._wait_init()
            self._eval_at_start(t_start)
            while True:
                gone = self._files_gone()
                if gone is not None:  # a step writes nothing that would show it (no store)
                    raise RunDirGone(gone)
                self._stopping = self._done(t_start)
                if self._stopping and not self._ahead:  # steps in flight when the run is done still finish
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
            gone = self._files_gone()
            if gone is not None:  # whatever failed first (a store read, a checkpoint task, an eval record, an MLflow
                raise RunDirGone(gone) from None  # write) did so because the run's files vanished: the one line
            raise
        finally:
            gone = self._files_gone() is not None
            if not gone:  # else nothing more is written (the store mark and the perf summary would re-create
                self._flush_complete_at_end()  # parts of a removed run dir; a vanished MLflow store takes nothing)
            if bar is not None:
                bar.close()
            self._bar = None
            if not gone:
                self._report(live=ended)
            if self.tracker.store_gone() is None:
                self.tracker.set_terminated(status)
            self._release_run_dir()  # the run dir's lock (Setup._hold_run_dir): its last write is done
        return RunResult(st.run_id, self.run_dir, self.tracker.run_id, self.tracking_uri,
                         self.store.path if self.store is not None else None, st.step, st.env_steps,
                         time.perf_counter() - t_start, self.last_eval, self.perf.cluster_peak_bytes() / 2**30,
                         interrupted=self.stop_requested)

    def _files_gone(self) -> str | None:
        """None while the run's own files are where the run made them, else the one line saying which vanished
        under the run: the run directory (removed or replaced, `storage.rundir.run_dir_gone`), its trajectory
        store, or its local MLflow store (`Tracker.store_gone`)."""
        why = run_dir_gone(self.run_dir, getattr(self, "_run_dir_id", None))
        store = getattr(self, "store", None)
        if why is None and store is not None and not (Path(store.path) / "zarr.json").is_file():
            why = (f"the trajectory store {store.path} was removed while the run trained; the run stopped and wrote "
                   f"nothing more (nothing was re-created): restore it and resume with runner.resume="
                   f"{self.state.run_id}, or start a new run")
        tracker = getattr(self, "tracker", None)
        return why if why is not None or tracker is None else tracker.store_gone()

    def _flush_complete_at_end(self) -> None:
        """The last finished step's store mark (Scheduler._flush_complete) when the loop ends, also by an error or an
        interrupt: its shards were all written, so it is shown; a failure to mark it is printed, not raised over
        the error that ended the run."""
        try:
            self._flush_complete()
        except Exception as exc:  # noqa: BLE001 - the run is ending; the step stays unshown, which is safe
            self.echo(f"dagrl: could not mark the last finished step complete in {self.store.path}: "
                      f"{type(exc).__name__}: {exc}")

    def _wait_init(self) -> None:
        """Wait (watched, nothing fetched) for the init graph's weights, so that the first step's wall holds the
        first step only; the wait is the perf event "init". A worker lost meanwhile is left to the first step's
        retry, as without the wait."""
        futs = [f for f in (self.weights, self.actor_weights) if hasattr(f, "key")]
        if futs:
            t0 = time.perf_counter()
            self._wait_or_lost(futs)
            self.perf.phase("init", self.state.step, time.perf_counter() - t0)

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
        trace = self._update_trace(n)
        if trace is not None and Path(trace).is_file():
            self.tracker.log_artifact(trace, "profile")

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

    def _eval_at_start(self, t_start: float) -> None:
        if self.cfg.runner.val_at_start and self.state.step == 0 and not self._eval_logged(0):
            self.tracker.log_metrics(self.evaluate(echo=False), step=0)
            self.echo(f"dagrl: eval before training: {self._eval_text()}")
            if self._best_unmarked():  # the starting policy is the best so far: a checkpoint of step 0 holds it
                self._last_ckpt = self.checkpoint(self.state.elapsed_s + time.perf_counter() - t_start)

    def _account_step(self, m: dict, t_start: float, bar) -> None:
        """After a training step: eval (every val_check_interval), log, checkpoint (every save_interval, and at a new
        best eval), bar (at the run's step), hook."""
        st, r = self.state, self.cfg.runner
        if st.step % r.val_check_interval == 0:
            m.update(self.evaluate(last=self._done(t_start)))  # the run's last eval also films (films_eval)
        self.tracker.log_metrics(m, step=st.step)  # before the checkpoint (module docstring)
        if st.step % r.save_interval == 0 or self._best_unmarked():  # a new best eval is checkpointed too
            self._last_ckpt = self.checkpoint(st.elapsed_s + time.perf_counter() - t_start)
        if bar is not None:
            bar.n = st.step  # the run's step, also after a rollback (Setup._rollback sets it back at once)
            post = {"env_sps": f"{m['rollout/env_steps_per_s']:.0f}",
                    "success": f"{m.get('env/success_once', float('nan')):.2f}"} \
                if "rollout/env_steps_per_s" in m else {"loss": f"{m['train/sft_loss']:.3f}"}
            if self.last_eval:
                post["eval"] = f"{self.last_eval['eval/success_once']:.2f}"
            bar.set_postfix(post)
        if self.after_step is not None:
            self.after_step(self)

    def _finish_run(self, t_start: float) -> str:
        """The final eval (not when stopped early, nor when the kept timeline has it) and checkpoint; returns the
        MLflow status."""
        st, cfg = self.state, self.cfg
        stopped = self.stop_requested
        if stopped is None and (not self.last_eval or st.step % cfg.runner.val_check_interval) \
                and not self._eval_logged(st.step):  # a resume at the end: the kept timeline has it
            self.tracker.log_metrics(self.evaluate(last=True), step=st.step)
        elapsed = st.elapsed_s + time.perf_counter() - t_start
        if self._last_ckpt is None or st.step % cfg.runner.save_interval or self._best_unmarked():
            self._last_ckpt = self.checkpoint(elapsed)
        if stopped is not None:
            self.echo(f"dagrl: stopped ({stopped}) after step {st.step}: checkpoint {self._last_ckpt}; continue "
                      f"with runner.resume={st.run_id} (or runner.resume=latest)")
            return "KILLED"
        self.tracker.log_text(str(self._last_ckpt), "final_checkpoint.txt")
        self.tracker.log_artifact(Path(self._last_ckpt), "final_checkpoint")
        return "FINISHED"

    def _eval_logged(self, step: int) -> bool:
        """Whether the run's timeline already holds an eval at `step` (a resume copies the points up to its
        checkpoint's step: evaluating again there would log a second value)."""
        return any(s == step for s, _ in self.tracker.get_metric_history("eval/success_once"))

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
        if r.stop_on_eval_success is not None and s.best(self._has_val)[1] >= r.stop_on_eval_success:
            return True
        return False

    # ----- eval and checkpoint graphs -----
    def evaluate(self, echo: bool = True, last: bool = False) -> dict:
        """The eval graph on the current weights; returns `eval/*` metrics (and updates the best eval).

        Every eval plays the same fixed episodes (episode i: reset seed `env.eval.seed + i`); the metrics hold the
        means, the Wilson 95 % interval of each success rate (`eval/success_once_ci_low` / `_ci_high`, the same for
        success_at_end; tasks.evalstats) and the paired gain with Newcombe's interval (`eval/gain_success_once`,
        `_ci_low`, `_ci_high`) over the run's baseline eval (tasks.evalstats.pick_baseline): its step-0 eval; else,
        when `policy.model_path` is a checkpoint whose run evaluated it on the same episodes (an SFT run's
        `checkpoints/global_step_N/hf`), that eval - so a run with `runner.val_at_start=false` has a gain from its
        first eval on; else its first eval. The per-episode outcomes go to `<run_dir>/evals/step_<N>.json` (seed ->
        success_once, success_at_end, return, episode_len). An eval significantly below the baseline (the paired
        interval entirely below 0) prints one warning line and sets the MLflow tag `dagrl.regression=step N`.
        With a validation split (env.eval.val_episodes > 0) the eval is followed by the validation split's
        (`_validate`: `val/*`, `eval/selected_success_once`), whose best, not the eval's, marks `checkpoints/best`
        (`RunState.best`); `eval/best_success_once` stays the highest eval, an optimistic figure.
        `echo`: print the eval's one line (with the gain and what it is against). `last`: the run is done after this
        step (`_done`) or this is `_finish_run`'s eval, so it films whatever `runner.eval_video_interval` says
        (`graphs.films_eval`).

        Raises:
            RuntimeError: the eval's episodes are not exactly the fixed ones (a bug: evals would not be paired).
        """
        st, ev = self.state, self.cfg.env.eval
        # made here, in the run dir as it is: the video task makes nothing
        video_dir = make_dir_in(self.run_dir, "videos", f"step_{st.step}") \
            if graphs.films_eval(self.cfg, st.step, last) else None
        earlier = {s: r for s, r in evalstats.read_evals(self.run_dir).items() if s < st.step}  # this timeline's
        m, outcomes, videos, extra = self._play_split("eval", None if video_dir is None else str(video_dir))
        if videos is not None:
            self._log_videos(videos, video_dir, m)
        if evalstats.improves(m["eval/success_once"], st.best_eval_success_once):  # never a non-finite value
            st.best_eval_success_once, st.best_eval_step = m["eval/success_once"], st.step
        m["eval/best_success_once"] = st.best_eval_success_once
        if ev.val_episodes:
            m.update(self._validate({**earlier, st.step: {"summary": evalstats.rate_summary(outcomes)}}))
        self.perf.phase("eval", st.step, m["time/eval"] + m.get("time/val", 0.0))
        self.last_eval = m
        base = self._baseline({**earlier, st.step: {**extra, "episodes": outcomes}})
        c = None if base is None else self._gain(m, outcomes, *base)
        if echo:
            self.echo(f"dagrl: eval at step {st.step}: {self._eval_text()}")
        if c is not None and c.significant_drop:
            self._warn_regression(c, base[1])
        return m

    def _play_split(self, split: str, video_dir: str | None = None) -> tuple[dict, dict, dict | None, dict]:
        """One eval graph of split `split` ("eval" or "val": `EvalConfig.split`) on the current weights, its
        per-episode record written (`<run_dir>/evals/step_<N>.json`, the validation split's under `evals/val/`):
        (metrics `<split>/{success_once, success_at_end, return, episode_len}` (means), their Wilson intervals
        `<split>/<rate>_ci_low/_high`, `<split>/num_episodes`, `time/<split>` (s); the outcome map (seed ->
        outcome); the videos' result or None; the record's extra fields: run_id, eval_seed, eval_layout).

        Raises:
            RuntimeError: the episodes played are not exactly the split's fixed ones (a bug: evals would not be
                paired)."""
        st, ev = self.state, self.cfg.env.eval.split(split)
        t0 = time.perf_counter()
        _, parts = self._compute(lambda attempt: graphs.build_eval(
            self.cfg, run_id=st.run_id, step=st.step, weights=self.weights, placement=self.placement,
            attempt=attempt, video_dir=video_dir, split=split, ema=self.cfg.algorithm.ema_decay > 0),
            "evaluation" if split == "eval" else "validation")
        videos = parts.pop() if video_dir is not None else None
        episodes = [e for part in parts for e in part]
        outcomes = evalstats.episode_outcomes(episodes)
        expected = {str(ev.seed + i) for i in range(ev.num_episodes)}
        if set(outcomes) != expected:
            key = "env.eval.seed" if split == "eval" else "env.eval.val_seed"
            missing, extra = sorted(expected - set(outcomes), key=int), sorted(set(outcomes) - expected, key=int)
            raise RuntimeError(f"{split} at step {st.step}: expected the {ev.num_episodes} episodes with seeds "
                               f"{key} + i = {ev.seed}..{ev.seed + ev.num_episodes - 1}; missing "
                               f"{missing[:5]}, unexpected {extra[:5]}")
        m = {f"{split}/{k}": float(np.mean([e[k] for e in episodes])) for k in evalstats.OUTCOMES}
        summary = evalstats.rate_summary(outcomes)
        for key in evalstats.RATES:
            m[f"{split}/{key}_ci_low"], m[f"{split}/{key}_ci_high"] = \
                summary[f"{key}_ci_low"], summary[f"{key}_ci_high"]
        m[f"{split}/num_episodes"] = float(len(episodes))
        m[f"time/{split}"] = time.perf_counter() - t0
        extra = {"run_id": st.run_id, "eval_seed": ev.seed, "eval_layout": evalstats.eval_layout(self.cfg)}
        evalstats.write_eval(self.run_dir, st.step, outcomes, extra, split=split, create_run_dir=False)
        return m, outcomes, videos, extra

    def _validate(self, run_evals: dict[int, dict]) -> dict:
        """The validation split's eval (env.eval.val_episodes > 0) at the current step: `val/*` metrics
        (`_play_split`), `val/best_success_once` (the best so far, which marks `checkpoints/best`) and
        `eval/selected_success_once`: the eval success_once of the step the validation chose (from `run_evals`,
        {step: eval record} of this timeline, the current step's included), the honest score of `best`."""
        st = self.state
        v = self._play_split("val")[0]
        if evalstats.improves(v["val/success_once"], st.best_val_success_once):
            st.best_val_success_once, st.best_val_step = v["val/success_once"], st.step
        v["val/best_success_once"] = st.best_val_success_once
        chosen = run_evals.get(st.best_val_step, {}).get("summary", {})
        v["eval/selected_success_once"] = float(chosen.get("success_once", float("nan")))
        return v

    def _baseline(self, run_evals: dict[int, dict]) -> tuple[dict, int | str] | None:
        """(outcomes, label) of the eval this run's eval gains pair with (tasks.evalstats.pick_baseline: the run's
        step-0 eval, else the SFT/start checkpoint's eval from its own run when it played the same episodes,
        else the run's first eval), or None (nothing to pair with; the current eval is the baseline itself)."""
        start = evalstats.start_checkpoint_eval(self.cfg.policy.model_path)  # one small file, once per eval
        base = evalstats.pick_baseline(run_evals, None if start is None else start[1])
        if base is None or base == ("run", self.state.step):
            return None
        if base[0] == "start":
            return start[1]["episodes"], start[0]
        return run_evals[base[1]]["episodes"], base[1]

    def _log_videos(self, videos: dict, video_dir: Path, m: dict) -> None:
        """The eval videos (tasks.video.eval_videos' result, also written as `videos.json` beside them) to MLflow
        under `videos/step_<N>`; `m` gets
        `time/eval_video` (s, part of time/eval) and `eval/videos` (files written). A failure is one line, never
        the run's end."""
        m["time/eval_video"] = float(videos["seconds"])
        m["eval/videos"] = float(len(videos["videos"]))
        step = self.state.step
        if videos["error"]:
            self.echo(f"dagrl: eval videos at step {step}: none written ({videos['error']}); the eval's metrics are "
                      f"unaffected; runner.eval_videos=0 skips them")
            return
        import json

        from storage.rundir import write_text_atomic
        write_text_atomic(video_dir / "videos.json", json.dumps({"step": step, **videos}, indent=1))
        differ = [v["episode_id"] for v in videos["videos"] if not v["return_matches"]]
        if differ:
            self.echo(f"dagrl: eval videos at step {step}: the replay of episode(s) {differ} did not reproduce the "
                      f"eval's return (the video may not show exactly what the eval played)")
        try:
            self.tracker.log_artifact(video_dir, f"videos/step_{step}")
        except Exception as exc:  # noqa: BLE001 - the files stay in the run dir
            self.echo(f"dagrl: eval videos at step {step}: written to {video_dir}, not logged to MLflow ({exc})")

    def _eval_text(self) -> str:
        """`success_once 0.438 [0.30, 0.58] over 48 episodes (success_at_end 0.290 [0.18, 0.43])` of the last eval."""
        m = self.last_eval
        once = evalstats.fmt_rate(m["eval/success_once"], m["eval/success_once_ci_low"],
                                  m["eval/success_once_ci_high"], int(m["eval/num_episodes"]))
        end = evalstats.fmt_rate(m["eval/success_at_end"], m["eval/success_at_end_ci_low"],
                                 m["eval/success_at_end_ci_high"])
        text = f"success_once {once} (success_at_end {end})"
        if "eval/gain_success_once" in m:
            gain = evalstats.fmt_gain(m["eval/gain_success_once"], m["eval/gain_success_once_ci_low"],
                                      m["eval/gain_success_once_ci_high"])
            text += f", gain {gain} vs {evalstats.eval_label(self._gain_label)}"
        if "val/success_once" in m:
            val = evalstats.fmt_rate(m["val/success_once"], m["val/success_once_ci_low"],
                                     m["val/success_once_ci_high"], int(m["val/num_episodes"]))
            text += (f"; validation success_once {val} (checkpoints/best: step {self.state.best_val_step}, "
                     f"eval {m['eval/selected_success_once']:.3f})")
        return text

    def _gain(self, m: dict, outcomes: dict, before: dict, label: int | str) -> evalstats.Comparison:
        """The paired gain of this eval (`outcomes`) over the baseline eval `before` (`label`: its step in this
        run, or the start checkpoint's label); `m` gets `eval/gain_success_once` and its interval."""
        c = evalstats.compare_evals(outcomes, before, "success_once")
        m["eval/gain_success_once"], m["eval/gain_success_once_ci_low"], m["eval/gain_success_once_ci_high"] = \
            c.diff, c.low, c.high
        self._gain_label = label
        return c

    def _warn_regression(self, c: evalstats.Comparison, label: int | str) -> None:
        """A significant drop below the baseline eval: one warning line and the MLflow tag `dagrl.regression`."""
        self.echo(evalstats.regression_line(self.state.step, label, c))
        try:
            self.tracker.client.set_tag(self.tracker.run_id, "dagrl.regression", f"step {self.state.step}")
        except Exception as exc:  # noqa: BLE001 - the warning line is printed; never fail a run for the tag
            self.echo(f"dagrl: could not set the MLflow tag dagrl.regression: {exc}")

    def _best_unmarked(self) -> bool:
        """The best eval is at the current step and no checkpoint of this step is marked best yet."""
        step, value, metric = self.state.best(self._has_val)
        if step != self.state.step:
            return False
        rec = read_best(self.run_dir)
        return rec is None or int(rec["step"]) != step or rec.get("value") != value or rec.get("metric") != metric

    def checkpoint(self, elapsed: float) -> str:
        """Write a checkpoint of the current step (the pipeline must be drained); returns its path."""
        from dataclasses import asdict
        st = self.state
        t0 = time.perf_counter()
        if self._ahead:  # the actor would be read while a later update may run (scheduler docstring)
            raise RuntimeError(f"checkpoint at step {st.step} with {len(self._ahead)} step(s) in flight")
        self._flush_complete()  # every step the checkpoint covers is complete in the store before it is written

        def build(attempt: int):
            meta = {"runner": {**asdict(st), "elapsed_s": elapsed}, "experiment": self.cfg.experiment}
            graph, key = graphs.build_checkpoint(run_id=st.run_id, step=st.step, run_dir=str(self.run_dir),
                                                 meta=meta, placement=self.placement, attempt=attempt, cfg=self.cfg,
                                                 group=self._group_specs(), weights=self.actor_weights,
                                                 dims=self.dims)
            return graph, [key]

        path = self._compute(build, "checkpoint")[1][0]
        best_step, best_value, metric = st.best(self._has_val)
        if best_step == st.step:  # written after the eval that set it: this checkpoint holds the best
            mark_best(self.run_dir, st.step, best_value, metric)
        prune_checkpoints(self.run_dir, self.cfg.runner.keep_checkpoints)  # never the best
        if self.cfg.runner.exact_resume and self.cfg.env.simulator == "maniskill":
            self._fresh_envs()
        self.perf.phase("checkpoint", st.step, time.perf_counter() - t0)
        return path

    def _fresh_envs(self) -> None:
        """runner.exact_resume: drop the run's env shards and eval shards on every worker; the next step and eval
        re-create them from the cursors the checkpoint just saved (tasks.rollout.get_shard), the path a resume takes,
        so the uninterrupted run and a resume from this checkpoint step the same freshly built envs."""
        from tasks import resident
        for part in ("shard", "eval"):
            self._run_on(resident.release, f"{self.state.run_id}/{part}/", what=f"releasing the {part} envs")
