"""The run context: one run's files and records, the runner's collaborator for everything it writes outside the
cluster.

`RunContext` owns the run directory (and its lock: one live driver per run dir), the MLflow `Tracker`, the trajectory
store and the one-timeline rule on disk; it holds the `RunState` (the progress the driver saves in checkpoints,
pipelines.runner.setup) and knows nothing of the cluster.

One timeline: a redone step never shows twice. A resume or a rollback (`restore`, after a lost actor) to step k
marks the store's steps >= k incomplete (each redone step is a new attempt, complete only once every shard wrote
it) and continues MLflow in a NEW run holding a copy of every point with step <= k (`Tracker.continue_from` /
`Tracker.fork`; MLflow's client cannot delete single points); the superseded run is tagged `dagrl.superseded_by`
and soft-deleted; the eval records after k go and the best-checkpoint pointer follows the state's best.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from pipelines.config import to_yaml
from pipelines.runner.setup import RunState, Resume, learns_from_rollouts, trajectory_fields, tracking_uri
from storage.checkpoints import load_checkpoint, read_best, sync_best
from storage.rundir import dir_identity, lock_run_dir, new_run_dir, run_dir_gone, write_resolved_config
from storage.tracking import Tracker
from storage.trajectories import TrajectoryStore
from tasks import evalstats
from tasks.config import Config, ConfigError
from tasks.envs import gripper_convention, store_attrs
from tasks.rollout import group_size
from tasks.seeding import TRAIN_SEED_RULE


class RunContext:
    """The run dir, its lock, the MLflow run, the trajectory store and the RunState of one run (module docstring).

    Made in three steps by the runner: `hold` (the lock, before anything is written), `open` (run dir, resolved
    config, tracker), `open_store` (once the env dims are known); `release` at the end."""

    NOT_ROLLED_BACK = ("run_id", "mlflow_run_id", "elapsed_s", "actor_generation")

    def __init__(self, cfg: Config, state: RunState, *, echo=print):
        self.cfg, self.state, self.echo = cfg, state, echo
        self.root = Path(cfg.run_root).resolve()
        self.run_dir: Path | None = None
        self.tracker: Tracker | None = None
        self.tracking_uri: str | None = None
        self.store: TrajectoryStore | None = None
        self._run_dir_id = None
        self._locks: list = []

    @property
    def has_val(self) -> bool:
        """A validation split (env.eval.val_episodes > 0) chooses checkpoints/best (`RunState.best`)."""
        return self.cfg.env.eval.val_episodes > 0

    def best(self) -> tuple[int, float, str]:
        """(step, value, metric) of the eval that chooses `checkpoints/best` (`RunState.best`)."""
        return self.state.best(self.has_val)

    # ----- the run dir and its lock -----
    def hold(self, run_lock=None) -> None:
        """Own the run directory before anything is written into it (`storage.rundir.lock_run_dir`: one live driver
        per run; a dead driver's lock is taken over with a note) and, when the algorithm reads a recording instead
        of rolling out (SFT), hold `sft.store` shared so that no recording writes it while this run reads it.
        `run_lock`: the run dir's lock the command took already (pipelines.run, before its cluster starts); it stays
        the command's to release. Released by `release`.

        Raises:
            ConfigError: another live driver owns the run (`runner.resume`), or a recording writes `sft.store`.
        """
        from storage.locks import LockBusy
        from storage.rundir import lock_store
        run_dir = self.root / self.cfg.experiment / self.state.run_id
        self._locks = []
        if run_lock is None or run_lock.path.parent != run_dir.absolute():
            try:
                run_lock = lock_run_dir(run_dir)
            except LockBusy as exc:
                raise ConfigError("runner.resume", self.cfg.runner.resume, str(exc)) from None
            self._locks.append(run_lock)
        if run_lock.note:
            self.echo(f"dagrl: {run_lock.note}")
        if not learns_from_rollouts(self.cfg) and self.cfg.sft.store:
            try:
                self._locks.append(lock_store(self.cfg.sft.store, shared=True))
            except LockBusy as exc:
                self.release()
                raise ConfigError("sft.store", self.cfg.sft.store, str(exc)) from None

    def release(self) -> None:
        """Release the locks `hold` took (idempotent)."""
        for lock in self._locks:
            lock.release()
        self._locks = []

    def open(self) -> None:
        """The run dir with the resolved config, and the run's MLflow Tracker (nothing logged yet)."""
        cfg = self.cfg
        uri = tracking_uri(cfg)
        self.run_dir = new_run_dir(self.root, cfg.experiment, self.state.run_id)
        self._run_dir_id = dir_identity(self.run_dir)  # files_gone: removed or replaced under the run
        write_resolved_config(self.run_dir, to_yaml(cfg))
        self.one_timeline_on_disk()  # a resume: evals after its step go, the best pointer follows its state
        self.tracker = Tracker(uri=uri, experiment=cfg.tracking.experiment or cfg.experiment,
                               run_name=self.state.run_id)
        self.tracking_uri = uri

    def log_run(self, resume: Resume) -> None:
        """Start the MLflow run's record: a resume continues in a new MLflow run holding the checkpoint's
        timeline (Tracker.continue_from); params, the changed keys (an artifact) and the resolved config."""
        if self.state.mlflow_run_id is not None:
            self.tracker.continue_from(self.state.mlflow_run_id, self.state.step, reason="resume")
        self.state.mlflow_run_id = self.tracker.run_id
        self.tracker.log_params({**resume.params, **resume.changed})
        if resume.changed:
            self.tracker.log_text("".join(f"{k}: {v}\n" for k, v in resume.changed.items()),
                                  f"resumes/step_{self.state.step}.yaml")
        self.tracker.log_artifact(self.run_dir / "config.yaml")

    def open_store(self, dims) -> TrajectoryStore | None:
        """The run's trajectory store (None: not saved, or no rollouts: SFT); a resume marks its later steps
        superseded. `dims`: (obs_dim, action_dim)."""
        cfg = self.cfg
        if not cfg.storage.save_trajectories or not learns_from_rollouts(cfg):
            return None
        store = TrajectoryStore.create(
            self.run_dir / "trajectories.zarr", fields=trajectory_fields(cfg, *dims), T=cfg.rollout.chunk_steps,
            num_envs=cfg.env.num_envs, shard_size=cfg.env.shard_size,
            attrs={"run_id": self.state.run_id, "env_id": cfg.env.env_id, "simulator": cfg.env.simulator,
                   "obs_mode": cfg.env.obs_mode, "control_mode": cfg.env.control_mode,
                   "reward_mode": cfg.env.reward_mode, "base_seed": cfg.env.seed,
                   "sim_backend": cfg.env.sim_backend, "auto_reset": cfg.env.auto_reset,
                   "ignore_terminations": cfg.env.ignore_terminations,
                   "seed_rule": TRAIN_SEED_RULE, "group_size": group_size(cfg),
                   "num_action_chunks": cfg.policy.num_action_chunks,
                   "max_episode_steps": cfg.env.max_episode_steps,
                   "gripper_convention": gripper_convention(cfg.env), **store_attrs(cfg.env)})
        store.invalidate_from(self.state.step)  # a resume: later steps are a superseded timeline
        self.store = store
        return store

    def files_gone(self) -> str | None:
        """None while the run's own files are where the run made them, else the one line saying which vanished
        under the run: the run directory (removed or replaced, `storage.rundir.run_dir_gone`), its trajectory
        store, or its local MLflow store (`Tracker.store_gone`)."""
        if self.run_dir is None:
            return None
        why = run_dir_gone(self.run_dir, self._run_dir_id)
        store = self.store
        if why is None and store is not None and not (Path(store.path) / "zarr.json").is_file():
            why = (f"the trajectory store {store.path} was removed while the run trained; the run stopped and wrote "
                   f"nothing more (nothing was re-created): restore it and resume with runner.resume="
                   f"{self.state.run_id}, or start a new run")
        return why if why is not None or self.tracker is None else self.tracker.store_gone()

    # ----- evals and the best checkpoint on disk -----
    def eval_logged(self, step: int) -> bool:
        """Whether the run's timeline already holds an eval at `step` (a resume copies the points up to its
        checkpoint's step: evaluating again there would log a second value)."""
        return any(s == step for s, _ in self.tracker.get_metric_history("eval/success_once"))

    def best_unmarked(self) -> bool:
        """The best eval is at the current step and no checkpoint of this step is marked best yet
        (tasks.evalstats.best_unmarked against `checkpoints/best`'s record)."""
        return evalstats.best_unmarked(self.best(), self.state.step, read_best(self.run_dir))

    # ----- one timeline (resume, rollback) -----
    def one_timeline_on_disk(self) -> None:
        """After the state was set to step k (a new run, a resume, a rollback): the eval records of steps > k
        (`<run_dir>/evals/`, both splits, a superseded timeline) are removed and the best-checkpoint pointer is made
        to agree with the state's best eval (`RunState.best`; `storage.checkpoints.sync_best`: its checkpoint if
        complete, else no pointer), so a best set after k never survives."""
        evalstats.discard_evals_after(self.run_dir, self.state.step)
        sync_best(self.run_dir, *self.best())

    def restore(self, ckpt) -> None:
        """Roll the run's records back to checkpoint `ckpt` (a path; None: to a fresh start at step 0), e.g. after
        the actor's worker was lost (its weights and optimizer with it).

        Restores every RunState field that describes training progress from the checkpoint's runner meta (step,
        env_steps, env cursors, best eval, and any field added later; not run_id, the MLflow run, the wall time
        spent, the actor group generation), marks the store's steps >= the restored step incomplete
        (`TrajectoryStore.invalidate_from`; the caller marks a finished step complete first), continues MLflow in
        a new run holding the points with step <= the restored step (`Tracker.fork`; the old run is soft-deleted),
        and drops the eval records after it and a best pointer beyond it (`one_timeline_on_disk`). The actor, the
        progress bar and the perf events are the caller's (pipelines.runner.recovery)."""
        st = self.state
        if ckpt is not None:
            saved = RunState(**load_checkpoint(ckpt, keys=("run",))["run"]["runner"])
        else:
            saved = RunState(run_id=st.run_id, cursors=[None] * self.cfg.env.num_shards)
        for f in fields(RunState):
            if f.name not in self.NOT_ROLLED_BACK:
                setattr(st, f.name, getattr(saved, f.name))
        if self.store is not None:
            self.store.invalidate_from(st.step)
        self.one_timeline_on_disk()
        st.mlflow_run_id = self.tracker.fork(st.step, reason=f"rollback to {'step %d' % st.step if ckpt else 'start'}")
