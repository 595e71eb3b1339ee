"""What a run does after lost or stalled workers: retry on a healthy placement, roll back, or give up in one line.

`Recovery` is the runner's collaborator between the watch (pipelines.runner.watcher: which workers, and
`plan_recovery`'s decision) and the run: `recover` re-places the run (and after a lost actor rolls its records
back to the last checkpoint, returning what the scheduler restores the actor from); `give_up` ends the run. It is
given the run's state, the watch, the run context and two callables of the loop: `checkpoint(elapsed)` (write one
of the current step) and `rollback(ckpt)` (the run's records, progress bar and perf events back to `ckpt`).

Every way a run gives up ends in `give_up`, which raises `RunStalled` with ONE line (pipelines.run prints it as
`error: <line>`, exit 1, no traceback):

    training step N: <what failed: the worker(s) and their state>; <what was saved: the checkpoint>; <what to change>

| give-up path                                                          | raised from                          |
|-----------------------------------------------------------------------|--------------------------------------|
| every attempt of a step / eval / checkpoint lost or stalled workers   | Scheduler.retrying (max_retries)     |
| no placement on the healthy workers after a loss or a stall           | `recover` (Watcher.plan_recovery)    |
| the cluster's workers not back after a loss                           | `recover` (Watcher.plan_recovery)    |
| the cluster itself gone (scheduler unreachable) during a wait         | Scheduler.retrying (`cluster_gone`)  |
| a task of the checkpoint graph failed (disk full, permissions)        | Scheduler.compute                    |
| placed workers lost or stalled in the init graph (no retry path)      | Scheduler.init_actor                 |

A recovery that goes on says so in one line too (`recover`): the lost workers, what is retried, and in brackets
the batch jobs that held them (a batch kind's job watch: the job that left the queue and its replacement) and,
after a lost actor, the checkpoint it is restored from and the `runner.resume=` command that continues from it
should the run stop.

N is the training step that failed, numbered as MLflow's (the first step is 1); for an evaluation or checkpoint
graph it is the step they follow. The checkpoint is written (of the last finished step, with the watch narrowed to
the actor's workers: a lost env worker does not stop it) whenever the actor's workers are healthy; else the line
names the latest checkpoint on disk, or says that none exists.
"""
from __future__ import annotations

import time

from pipelines.runner.watcher import NoPlacement, RunStalled, one_line
from storage.checkpoints import latest_checkpoint


class Recovery:
    """The run's side of a loss (module docstring). `stopping`: a give-up is writing its checkpoint (no retry
    then: Scheduler.retrying)."""

    def __init__(self, cfg, state, *, watch, ctx, checkpoint, rollback, echo=print, jobs=None):
        self.cfg, self.state, self.watch, self.ctx, self.echo = cfg, state, watch, ctx, echo
        self.checkpoint, self.rollback = checkpoint, rollback
        self.jobs = jobs  # worker names -> what the cluster says of their batch jobs ('' when none: ClusterHandle)
        self.stopping = False

    def give_up(self, failed: str, fix: str, *, actor_healthy: bool, step: int | None = None,
                unsaved: str = "the actor's weights were on the failed worker(s)"):
        """End the run with RunStalled (module docstring's one line); never returns.

        failed: what failed (workers and their state); fix: what to change. actor_healthy: the actor's workers
        hold the last finished step's weights, so a checkpoint of it is written first (the watch narrowed to them);
        else the latest checkpoint on disk is named (unsaved: why none was written). step: the N of the line
        (default: the step being trained).
        """
        st = self.state
        n = st.step + 1 if step is None else step
        if self.stopping:  # failed while writing the give-up checkpoint: the give-up's caller reports it
            raise RunStalled(failed)
        self.stopping = True
        ckpt, why = None, unsaved
        if actor_healthy:
            elapsed = st.elapsed_s + time.perf_counter() - self.watch.started
            try:
                with self.watch.narrowed(self.watch.placement.actor_workers[:self.watch.ranks]):
                    ckpt = self.checkpoint(elapsed)
            except Exception as exc:  # noqa: BLE001 - said in the line; the latest checkpoint is named instead
                why = f"writing it failed: {one_line(exc)}"
        if ckpt is not None:
            saved = f"wrote checkpoint {ckpt} (step {st.step}, the last finished step)"
        else:
            ckpt = latest_checkpoint(self.ctx.run_dir) if self.ctx.run_dir is not None else None
            saved = (f"no checkpoint written ({why}); " +
                     (f"the latest is {ckpt}" if ckpt is not None else "no checkpoint of this run exists yet"))
        raise RunStalled(f"training step {n}: {failed}; {saved}; {fix}, {self._resume_hint(ckpt)}")

    def _resume_hint(self, ckpt) -> str:
        if ckpt is None:
            return "then start it again (no checkpoint to resume from)"
        return f"then resume with `python -m pipelines.run conf=<this config> runner.resume={self.state.run_id}`"

    def _details(self, lost: set[str], actor_lost: bool, ckpt) -> str:
        """The recovery line's tail: the batch jobs that held the `lost` workers (`jobs`: the job, its replacement)
        and, after a lost actor, the checkpoint it is restored from and the command that resumes from it should
        the run stop (` (...)`; empty when there is nothing to add)."""
        parts = []
        if actor_lost:
            parts.append(f"from {ckpt}" if ckpt is not None else "no checkpoint yet: a fresh actor from step 0")
        said = self.jobs(self.watch.worker_names(lost)) if self.jobs is not None else ""
        if said:
            parts.append(said)
        if actor_lost and ckpt is not None:
            parts.append(f"should this run stop, {self._resume_hint(ckpt).removeprefix('then ')}")
        return f" ({'; '.join(parts)})" if parts else ""

    def recover(self, lost: set[str], step: int, busy: set[str] = frozenset(),
                during: str | None = None) -> tuple[str | None, str] | None:
        """Re-place the run on the healthy workers (`Watcher.plan_recovery`: stuck workers restarted, paused ones
        left out) and drop the resident env shards, so that every shard is re-created from the step's seed cursor.
        If the actor's worker was lost or stalled (its weights and optimizer with it), or with several ranks any
        rank was busy, roll the run back to the latest checkpoint (`rollback`; a fresh start when there is none)
        and bump the multi-rank group's generation (rebuilt on a new port).

        `step`: the last finished step (the re-init's key tag); `during`: what was running, for the line (default
        "step <step + 1>", the training step in flight).

        Returns:
            None (the actor is intact), or (checkpoint path or None, key tag) to restore the actor from
            (Scheduler.init_actor).

        Raises:
            RunStalled: no healthy placement, or the cluster's workers are not back (`give_up`).
        """
        st = self.state
        if self.stopping:  # not reached (no retry while stopping): a safe bound
            raise RunStalled(f"training step {st.step + 1}: worker(s) {sorted(lost)} lost or stalled while "
                             f"writing the give-up checkpoint")
        try:
            plan = self.watch.plan_recovery(lost, busy, run_id=st.run_id, generation=st.actor_generation)
        except NoPlacement as exc:
            self.give_up(exc.failed, exc.fix, actor_healthy=exc.actor_healthy)
        ckpt = latest_checkpoint(self.ctx.run_dir) if plan.actor_lost else None
        self.echo(f"dagrl: worker(s) {sorted(lost)} {'lost or stalled' if plan.stalled else 'lost'} during "
                  f"{during or f'step {step + 1}'}; "
                  f"{'restoring the actor from the last checkpoint and ' if plan.actor_lost else ''}retrying"
                  + (f" without {sorted(plan.paused)}" if plan.paused else "")
                  + self._details(lost, plan.actor_lost, ckpt))
        self.watch.replace_placement(plan.placement)
        from tasks import resident
        self.watch.run_on(resident.release, f"{st.run_id}/shard/", what="releasing the env shards")
        if not plan.actor_lost:
            return None
        self.rollback(ckpt)  # RunState from the checkpoint (or fresh), one timeline in store/MLflow
        ranks = self.watch.ranks
        if ranks > 1:
            st.actor_generation += 1
        return (None if ckpt is None else str(ckpt)), f"r{step}" + (f"-g{st.actor_generation}" if ranks > 1 else "")


__all__ = ["Recovery", "RunStalled"]
