"""The training loop of one run (`Runner`, pipelines.runner.loop) and its collaborators, one module each:

    loop.py       the driver: step / eval / checkpoint cadence, the run's end and report
    scheduler.py  the actor's weights and the pipeline of step graphs; the one retry loop
    context.py    the run dir and its lock, the MLflow run, the trajectory store, the one timeline on disk
    watcher.py    every wait on the cluster: lost, paused, stuck, silent workers, and the recovery decision
    recovery.py   what the run does after a loss: retry, roll back, or give up in one line
    evals.py      the eval graphs and the run's eval decisions (pure functions in tasks.evalstats)
    perf.py       the perf events and `perf_summary.json`
    setup.py      offline: run ids, the RunState, `resolve_resume`

Each collaborator is given what it uses when it is made; none reaches into another's attributes.
"""
from pipelines.runner.loop import Runner
from pipelines.runner.scheduler import StepFailed
from pipelines.runner.setup import (RunResult, RunState, Resume, new_run_id, resolve_resume, run_params,
                                    trajectory_fields)

__all__ = ["Runner", "RunResult", "RunState", "Resume", "StepFailed", "new_run_id", "resolve_resume",
           "run_params", "trajectory_fields"]
