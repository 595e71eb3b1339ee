"""Entry point: `python -m pipelines.run [conf=NAME] [key=value ...]`.

Composes the Hydra config (conf/config.yaml + conf/conf/NAME.yaml + overrides), validates it completely before any
worker starts, checks where it will write (`run_root` writable, `tracking.uri` reachable: an http(s) server
answers within seconds; `pipelines.cli.preflight`), starts the local Dask cluster (or connects to an existing
scheduler: `cluster=address cluster.address=tcp://HOST:PORT`), prints the dashboard link, and trains. Exit codes:
0 done, 2 bad config, an unwritable `run_root` or unusable `tracking.uri`, or a cluster that cannot start (one
line on stderr, nothing written; a `runner.resume` that cannot be honoured is found before the cluster starts,
also a run another live driver owns: one driver per run dir, `storage.rundir.lock_run_dir`, the line names it), 1 a
failure during training (a lost cluster, or a step stopped by a non-finite value: one line `error: training step N:
...`; the run directory, its trajectory store or its MLflow store removed under the run: one line naming it,
nothing re-created), 130 interrupted. The first SIGINT (Ctrl-C) or SIGTERM during training finishes the step in flight, writes a checkpoint and exits 130
(resume with `runner.resume=<run_id>` or `runner.resume=latest`); a second one exits at once.

Extra flags: `--show` prints the resolved config and exits (also of an experiment that leaves required keys `???`:
marked and named). `--help` also lists the experiments and the config groups' options.
`-m` / `--multirun`: a sweep, Hydra's way: every
`key=a,b,...` (a comma list; also Hydra's `range(...)`) is swept and the jobs are the grid of all combinations, each
checked before the first starts, run one after another on one embedded cluster, tagged in MLflow with the sweep id;
its report: `python -m pipelines.compare --sweep ID` (pipelines.sweep). Without `-m` a comma list is refused (one
line). `--jobs N` / `-j N` (with `-m`, on an existing cluster: `-m -j 2 cluster=address cluster.address=...`): up to N
jobs at once, each its own driver process with its output in `<run_root>/sweeps/ID/job-I.log`, one job a GPU worker
where the jobs fit (pipelines.sweep_jobs); the embedded cluster and the batch kinds refuse it (one line). An
unknown flag, or a word that is not a Hydra override (`key=value`, `+key=value`, `~key`), exits 2 with one line.

Examples:
  python -m pipelines.run                                           # the default experiment (conf=pushcube_ppo)
  python -m pipelines.run conf=smoke runner.max_steps=3 env.num_envs=8
  python -m pipelines.run conf=pushcube_pi0_grpo policy.model_path=SFT_RUN/checkpoints/global_step_30/hf
  python -m pipelines.run runner.resume=latest                      # continue the newest run of the experiment
  python -m pipelines.run conf=smoke --show                         # print the resolved config, start nothing
  python -m pipelines.run -m conf=smoke seed=1,2,3 algorithm.lr=1e-4,3e-4   # a sweep: 6 runs, then its report
"""
from __future__ import annotations

import sys

from pipelines.cli import (load, overrides_and_flags, preflight, signal_handlers,  # the entry points' shared plumbing
                           with_cluster)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.run ...` (module docstring). Returns the exit code."""
    from pipelines.sweep_jobs import UsageError, jobs_flag
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # `--jobs N` / `-j N`: a sweep's jobs side by side (pipelines.sweep_jobs); its value is not key=value
        argv, jobs_at_once = (argv, None) if {"-h", "--help"} & set(argv) else jobs_flag(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    words = overrides_and_flags(argv, __doc__, "python -m pipelines.run",
                                {"--show": "print the resolved config and exit",
                                 "-m": "a sweep: run every combination of the comma lists (--multirun)",
                                 "--multirun": "as -m", "--jobs N": "with -m: up to N jobs at once (-j N)"})
    if isinstance(words, int):
        return words
    flags, overrides = words
    if flags & {"-m", "--multirun"}:  # Hydra's multirun: the grid of the comma lists (pipelines.sweep)
        from pipelines.sweep import run_sweep
        return run_sweep(overrides, train=_train, show="--show" in flags, jobs_at_once=jobs_at_once)
    if jobs_at_once is not None:
        print(f"error: --jobs {jobs_at_once}: runs a sweep's jobs side by side; add -m (python -m pipelines.run -m "
              f"--jobs {jobs_at_once} cluster=address cluster.address=tcp://HOST:PORT KEY=A,B ...)", file=sys.stderr)
        return 2
    from tasks.config import ConfigError
    if "--show" in flags:  # also an experiment whose required keys are left ??? (shown marked: pipelines.cli.show)
        from pipelines.cli import show
        return show(overrides, command="run")
    cfg = load(overrides, command="run")  # the one check path (pipelines.validate's too)
    if cfg is None:
        return 2
    if not preflight(cfg):  # run_root writable, tracking.uri reachable: before a resume reads it, before any worker
        return 2
    if cfg.runner.resume is None:  # a new run: the Runner takes its new run dir's lock before writing into it
        return with_cluster(cfg, lambda handle: _train(cfg, handle))
    # which run, which checkpoint, same training keys, no live driver on it: offline, before any worker; then the
    # run dir's lock, held until the command ends (a second driver on the run is refused in one line, exit 2)
    from pathlib import Path

    from pipelines.runner.setup import resolve_resume
    from storage.locks import LockBusy
    from storage.rundir import lock_run_dir
    try:
        run_id = resolve_resume(cfg).state.run_id
        lock = lock_run_dir(Path(cfg.run_root).resolve() / cfg.experiment / run_id)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except LockBusy as exc:
        print(f"error: {ConfigError('runner.resume', cfg.runner.resume, str(exc))}", file=sys.stderr)
        return 2
    with lock:
        return with_cluster(cfg, lambda handle: _train(cfg, handle, lock))


class graceful_stop(signal_handlers):
    """While active (a context manager, main thread only): the first SIGINT/SIGTERM asks `runner` to stop after
    the step in flight and write a checkpoint (`Runner.request_stop`); a second one raises KeyboardInterrupt at
    once (no checkpoint). The previous handlers are restored on exit."""

    def __init__(self, runner, *, out=sys.stderr):
        self.runner, self.out = runner, out

    def __enter__(self):
        super().__enter__()
        from pipelines.cli import interrupted_by
        name = interrupted_by()  # a Ctrl-C before, swallowed on its way (pipelines.cli.check_interrupted)
        if name is not None and self.runner.stop_requested is None:
            self._stop(name)
        return self

    def _stop(self, name: str) -> None:
        self.runner.request_stop(name)
        # a signal handler: no tqdm lock here (the main thread may hold it); with the progress bar up, end its line
        lead = "\n" if getattr(self.runner, "_bar", None) is not None else ""
        print(f"{lead}dagrl: {name}: stopping after the step in flight and writing a checkpoint (again to exit at "
              f"once, without one)", file=self.out, flush=True)

    def handler(self, signum, frame) -> None:
        import signal
        name = signal.Signals(signum).name
        if self.runner.stop_requested is not None:  # the second one: exit now
            raise KeyboardInterrupt
        self._stop(name)


def _train(cfg, handle, run_lock=None, *, tags=None, record=None) -> int:
    """Train one run on `handle`'s cluster; returns the exit code. `tags`: MLflow tags set on the run as soon as it
    exists (a sweep's, `pipelines.sweep`); `record`: a dict given the run's `run_id`, `run_dir`, `mlflow_run_id`
    and `tracking_uri` then."""
    from pipelines.runner import Runner
    print(f"dagrl: experiment {cfg.experiment} | dashboard {handle.dashboard_link}", flush=True)
    from tasks.evalstats import fmt_rate
    runner = Runner(cfg, handle, run_lock=run_lock)
    if tags:
        runner.tracker.set_tags(tags)
    if record is not None:
        record.update(run_id=runner.state.run_id, run_dir=str(runner.run_dir), mlflow_run_id=runner.tracker.run_id,
                      tracking_uri=runner.tracking_uri)
    print(f"dagrl: run {runner.state.run_id} | run dir {runner.run_dir} | MLflow {runner.tracking_uri} "
          f"(run {runner.tracker.run_id})", flush=True)
    start_step, start_env_steps = runner.state.step, runner.state.env_steps  # a resume starts at its checkpoint
    with graceful_stop(runner):
        res = runner.run()
    from tasks import resident
    resident.release_on(handle.client, f"{runner.state.run_id}/")  # its env shards, actor and replicas
    if res.interrupted is not None:
        print(f"interrupted ({res.interrupted}) at step {res.steps}: checkpointed; resume with "
              f"runner.resume={res.run_id}", file=sys.stderr)
        return 130
    ev = res.last_eval
    nan = float("nan")

    def rate(key: str) -> str:  # the rate with its Wilson 95 % interval (tasks.evalstats.fmt_rate)
        return fmt_rate(ev.get(f"eval/{key}", nan), ev.get(f"eval/{key}_ci_low", nan), ev.get(f"eval/{key}_ci_high", nan))
    evaluated = (f"eval success_once {rate('success_once')} success_at_end {rate('success_at_end')} over "
                 f"{ev['eval/num_episodes']:.0f} episodes ({best_text(runner.state, ev)})"
                 if ev.get("eval/num_episodes")  # else no eval ran in this session: nothing to summarise
                 else f"no eval in this session (the run's evals: {runner.run_dir / 'evals'})")
    print(f"dagrl: done: {session_text(res.steps, res.env_steps, res.wall_s, start_step, start_env_steps)} | "
          f"{evaluated} | peak memory {res.peak_rss_gb:.2f} GiB")
    from storage.tracking import view_hint
    where = [f"trajectories {res.store_path}"] if res.store_path is not None else []  # SFT: it stores none
    where.append(f"view: {view_hint(res.tracking_uri, runner.tracker.experiment_id, res.mlflow_run_id)}")
    print("dagrl: " + " | ".join(where))
    return 0


def session_text(step: int, env_steps: int, wall_s: float, start_step: int = 0, start_env_steps: int = 0) -> str:
    """What the done line says of the training: the run's step at the end, then what THIS driver session did (the
    steps from `start_step`, the checkpoint's step a resume started from; env steps, when any; its wall, s), e.g.
    `step 26 | this session: steps 17-26 (10), 1600 env steps in 128 s; the perf table above is the whole run's`.
    The perf table (pipelines.runner.perf.format_table) covers every session of the run; a new run's one session
    is the whole run."""
    n = step - start_step
    did = (f"steps {start_step + 1}-{step} ({n})" if n > 1 else f"step {step} (1)" if n == 1 else
           f"no training step (the checkpoint was at step {start_step})")
    played = env_steps - start_env_steps  # none for SFT (its samples come from a store): not said
    text = f"step {step} | this session: {did}{f', {played} env steps' if played else ''} in {wall_s:.0f} s"
    return text if start_step == 0 else f"{text}; the perf table above is the whole run's"


def best_text(state, ev: dict) -> str:
    """What the done line says of checkpoints/best: `best success_once 0.620 at step 18`, or with a validation split
    `checkpoints/best: step 18 (validation 0.540, eval 0.600; the highest eval 0.620)`."""
    if "val/best_success_once" not in ev:
        return f"best success_once {state.best_eval_success_once:.3f} at step {state.best_eval_step}"
    return (f"checkpoints/best: step {state.best_val_step} (validation {state.best_val_success_once:.3f}, eval "
            f"{ev['eval/selected_success_once']:.3f}; the highest eval {state.best_eval_success_once:.3f})")


def sweep_job_main(argv: list[str] | None = None) -> int:
    """One job of a sweep run side by side (`python -m pipelines.run -m --jobs N`): `python -c
    pipelines.sweep_jobs.CHILD JOB_FILE`, the file `pipelines.sweep_jobs` writes (overrides, MLflow tags, the record
    file), through this command's training path. Returns the exit code as `main` (0, 1, 2, 130)."""
    import json
    from pathlib import Path

    from pipelines.cli import start
    from pipelines.sweep_jobs import JobRecord
    argv = start(argv, sweep_job_main.__doc__)
    if argv is None:
        return 0
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("error: a sweep job's process takes one job file, written by `python -m pipelines.run -m "
              "--jobs N ...` (a sweep's jobs side by side); run a sweep with that command", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    print(f"dagrl: {spec['label']}: python -m pipelines.run {' '.join(spec['overrides'])}", flush=True)
    cfg = load(spec["overrides"], command="run")
    if cfg is None:
        return 2
    record = JobRecord(Path(spec["record"]))
    return with_cluster(cfg, lambda handle: _train(cfg, handle, tags=spec["tags"], record=record))


def sweep_job_entry() -> int:
    """A sweep job process's entry (`python -c`; not a command of its own): started in its own session by the
    sweep's driver, which passes the terminal's Ctrl-C on, it gets Python's own SIGINT handler back even where the
    sweep was started with SIGINT ignored (a background job), then `entry(sweep_job_main)`."""
    import signal

    from pipelines.cli import entry
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return entry(sweep_job_main)


if __name__ == "__main__":
    from pipelines.cli import entry
    sys.exit(entry(main))
