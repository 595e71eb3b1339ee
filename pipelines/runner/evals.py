"""A training run's evaluations: the eval graph on the current weights, its record, and the run's eval decisions.

`Evaluator` is the runner's collaborator for evals. It plays the eval graph (and the validation split's) through
the scheduler (`Scheduler.compute`: watched, retried after a loss), writes each eval's per-episode record
(`<run_dir>/evals/step_<N>.json`, tasks.evalstats) and asks tasks.evalstats' pure functions of eval records for the
decisions: the best eval so far (`best_after`), the baseline of the gains of a run started from a checkpoint
(`baseline`: the run's step-0 eval, else the start checkpoint's own eval on the same episodes, else the run's
first; a run from scratch has none), the paired gain (`gain_metrics`) and
the regression warning (`Comparison.significant_drop`). pipelines.eval scores a checkpoint with the same functions.
"""
from __future__ import annotations

import time
from pathlib import Path

from pipelines import graphs
from storage.rundir import make_dir_in
from tasks import evalstats


class Evaluator:
    """The evals of one run (module docstring): `evaluate` at the current step, `text` of the last one.
    Collaborators: the run's state and context (run dir, tracker), the scheduler (`compute`, the weights and the
    placement), the perf recorder."""

    def __init__(self, cfg, state, *, ctx, sched, perf, echo=print):
        self.cfg, self.state, self.ctx, self.sched, self.perf, self.echo = cfg, state, ctx, sched, perf, echo
        self.last: dict = {}  # the last eval's metrics
        self._gain_label: int | str | None = None

    def evaluate(self, echo: bool = True, last: bool = False) -> dict:
        """The eval graph on the current weights; returns `eval/*` metrics (and updates the best eval).

        Every eval plays the same fixed episodes (episode i: reset seed `env.eval.seed + i`); the metrics hold the
        means, the Wilson 95 % interval of each success rate (`eval/success_once_ci_low` / `_ci_high`, the same for
        success_at_end; tasks.evalstats) and the paired gain with Newcombe's interval (`eval/gain_success_once`,
        `_ci_low`, `_ci_high`) over the run's baseline eval (tasks.evalstats.baseline), for a run that started from
        a checkpoint (`policy.model_path`; a run from scratch has no gain and no regression warning): its step-0
        eval; else,
        when `policy.model_path` is a checkpoint whose run evaluated it on the same episodes (an SFT run's
        `checkpoints/global_step_N/hf`), that eval - so a run with `runner.val_at_start=false` has a gain from its
        first eval on; else its first eval. The per-episode outcomes go to `<run_dir>/evals/step_<N>.json` (seed ->
        success_once, success_at_end, return, episode_len). An eval significantly below the baseline (the paired
        interval entirely below 0) prints one warning line and sets the MLflow tag `dagrl.regression=step N`.
        With a validation split (env.eval.val_episodes > 0) the eval is followed by the validation split's
        (`_validate`: `val/*`, `eval/selected_success_once`), whose best, not the eval's, marks `checkpoints/best`
        (`RunState.best`); `eval/best_success_once` stays the highest eval, an optimistic figure.
        `echo`: print the eval's one line (with the gain and what it is against). `last`: the run is done after this
        step or this is the run's final eval, so it films whatever `runner.eval_video_interval` says
        (`graphs.films_eval`).

        Raises:
            RuntimeError: the eval's episodes are not exactly the fixed ones (a bug: evals would not be paired).
        """
        st, ev, run_dir = self.state, self.cfg.env.eval, self.ctx.run_dir
        # made here, in the run dir as it is: the video task makes nothing
        video_dir = make_dir_in(run_dir, "videos", f"step_{st.step}") \
            if graphs.films_eval(self.cfg, st.step, last) else None
        earlier = {s: r for s, r in evalstats.read_evals(run_dir).items() if s < st.step}  # this timeline's
        m, outcomes, videos, extra = self._play_split("eval", None if video_dir is None else str(video_dir))
        if videos is not None:
            self._log_videos(videos, video_dir, m)
        st.best_eval_success_once, st.best_eval_step = evalstats.best_after(
            m["eval/success_once"], (st.best_eval_success_once, st.best_eval_step), st.step)  # never a non-finite
        m["eval/best_success_once"] = st.best_eval_success_once
        if ev.val_episodes:
            m.update(self._validate({**earlier, st.step: {"summary": evalstats.rate_summary(outcomes)}}))
        self.perf.phase("eval", st.step, m["time/eval"] + m.get("time/val", 0.0))
        self.last = m
        start = evalstats.start_checkpoint_eval(self.cfg.policy.model_path)  # one small file, once per eval
        base = evalstats.baseline({**earlier, st.step: {**extra, "episodes": outcomes}}, start, st.step,
                                  warm_start=bool(self.cfg.policy.model_path))  # from scratch: no gain
        c = None
        if base is not None:
            gain, c = evalstats.gain_metrics(outcomes, base[0])
            m.update(gain)
            self._gain_label = base[1]
        if echo:
            self.echo(f"dagrl: eval at step {st.step}: {self.text()}")
        if c is not None and c.significant_drop:
            self._warn_regression(c, base[1])
        return m

    def _play_split(self, split: str, video_dir: str | None = None) -> tuple[dict, dict, dict | None, dict]:
        """One eval graph of split `split` ("eval" or "val": `EvalConfig.split`) on the current weights, its
        per-episode record written (`<run_dir>/evals/step_<N>.json`, the validation split's under `evals/val/`):
        (metrics `<split>/{success_once, success_at_end, return, episode_len}` (means), their Wilson intervals
        `<split>/<rate>_ci_low/_high`, `<split>/num_episodes`, `time/<split>` (s): tasks.evalstats.split_metrics;
        the outcome map (seed -> outcome); the videos' result or None; the record's extra fields: run_id,
        eval_seed, eval_layout).

        Raises:
            RuntimeError: the episodes played are not exactly the split's fixed ones (a bug: evals would not be
                paired)."""
        st, ev, sched = self.state, self.cfg.env.eval.split(split), self.sched
        t0 = time.perf_counter()
        _, parts = sched.compute(lambda attempt: graphs.build_eval(
            self.cfg, run_id=st.run_id, step=st.step, weights=sched.weights, placement=sched.placement,
            attempt=attempt, video_dir=video_dir, split=split, ema=self.cfg.algorithm.ema_decay > 0),
            "evaluation" if split == "eval" else "validation")
        videos = parts.pop() if video_dir is not None else None
        episodes = [e for part in parts for e in part]
        m, outcomes = evalstats.split_metrics(episodes, split)
        evalstats.check_fixed_episodes(outcomes, ev.seed, ev.num_episodes, what=f"{split} at step {st.step}",
                                       key="env.eval.seed" if split == "eval" else "env.eval.val_seed")
        m[f"time/{split}"] = time.perf_counter() - t0
        extra = {"run_id": st.run_id, "eval_seed": ev.seed, "eval_layout": evalstats.eval_layout(self.cfg)}
        evalstats.write_eval(self.ctx.run_dir, st.step, outcomes, extra, split=split, create_run_dir=False)
        return m, outcomes, videos, extra

    def _validate(self, run_evals: dict[int, dict]) -> dict:
        """The validation split's eval (env.eval.val_episodes > 0) at the current step: `val/*` metrics
        (`_play_split`), `val/best_success_once` (the best so far, which marks `checkpoints/best`) and
        `eval/selected_success_once`: the eval success_once of the step the validation chose (from `run_evals`,
        {step: eval record} of this timeline, the current step's included), the honest score of `best`."""
        st = self.state
        v = self._play_split("val")[0]
        st.best_val_success_once, st.best_val_step = evalstats.best_after(
            v["val/success_once"], (st.best_val_success_once, st.best_val_step), st.step)
        v["val/best_success_once"] = st.best_val_success_once
        chosen = run_evals.get(st.best_val_step, {}).get("summary", {})
        v["eval/selected_success_once"] = float(chosen.get("success_once", float("nan")))
        return v

    def _log_videos(self, videos: dict, video_dir: Path, m: dict) -> None:
        """The eval videos (tasks.video.eval_videos' result, also written as `videos.json` beside them) to MLflow
        under `videos/step_<N>`; `m` gets `time/eval_video` (s, part of time/eval) and `eval/videos` (files
        written). A failure is one line, never the run's end."""
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
            self.ctx.tracker.log_artifact(video_dir, f"videos/step_{step}")
        except Exception as exc:  # noqa: BLE001 - the files stay in the run dir
            self.echo(f"dagrl: eval videos at step {step}: written to {video_dir}, not logged to MLflow ({exc})")

    def text(self) -> str:
        """`success_once 0.438 [0.30, 0.58] over 48 episodes (success_at_end 0.290 [0.18, 0.43])` of the last eval
        (with its gain and what it is against, and the validation split's figures when there are some)."""
        m = self.last
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

    def _warn_regression(self, c: evalstats.Comparison, label: int | str) -> None:
        """A significant drop below the baseline eval: one warning line (tasks.evalstats.regression_line) and the
        MLflow tag `dagrl.regression`."""
        self.echo(evalstats.regression_line(self.state.step, label, c))
        tracker = self.ctx.tracker
        try:
            tracker.client.set_tag(tracker.run_id, "dagrl.regression", f"step {self.state.step}")
        except Exception as exc:  # noqa: BLE001 - the warning line is printed; never fail a run for the tag
            self.echo(f"dagrl: could not set the MLflow tag dagrl.regression: {exc}")
