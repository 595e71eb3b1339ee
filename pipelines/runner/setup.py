"""Run set-up: run ids and dirs, the MLflow run, resume, and the one-timeline rollback.

`resolve_resume(cfg)` answers `runner.resume` OFFLINE (no cluster, no worker): which run, which checkpoint, whether
its shard layout and training keys match this config; `pipelines.run` calls it before the cluster starts and the
`Runner` again when it starts, so a bad resume is one line and exit 2, and nothing is written.

`Setup` is a mixin of `pipelines.runner.Runner` (it uses the runner's `cfg`, `root`, `client`, `placement`,
`state`, `store`, `tracker`, `echo`): the MLflow run and run dir (`_open_run`), the trajectory store
(`_open_store`), the actor's init graph (`_init_actor`) and `_rollback`.

One timeline: a redone step never shows twice. A resume or a rollback (`_rollback`, after a lost actor) to step k
marks the store's steps >= k incomplete (each redone step is a new attempt, complete only once every shard wrote
it) and continues MLflow in a NEW run holding a copy of every point with step <= k (`Tracker.continue_from` /
`Tracker.fork`; MLflow's client cannot delete single points); the superseded run is tagged `dagrl.superseded_by`
and soft-deleted.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path

from pipelines import graphs
from pipelines.cluster import _host
from pipelines.config import to_dict, to_yaml
from storage.checkpoints import latest_checkpoint, load_checkpoint, sync_best
from storage.rundir import (dir_identity, find_run_dir, latest_started_run, lock_run_dir, new_run_dir, run_owner,
                            write_resolved_config)
from storage.tracking import Tracker, default_tracking_uri, flatten_config
from storage.trajectories import FieldSpec, TrajectoryStore
from tasks import trajectory
from tasks.config import Config, ConfigError
from tasks.envs import gripper_convention, store_attrs
from tasks.evalstats import discard_evals_after
from tasks.rollout import group_size
from tasks.seeding import TRAIN_SEED_RULE


@dataclass
class RunState:
    """Everything the driver needs to continue a run; saved as checkpoint meta."""

    run_id: str
    mlflow_run_id: str | None = None
    step: int = 0  # training steps completed
    env_steps: int = 0
    cursors: list = field(default_factory=list)
    elapsed_s: float = 0.0
    best_eval_success_once: float = -1.0  # the highest eval/success_once so far and its step
    best_eval_step: int = -1
    # with a validation split (env.eval.val_episodes > 0): the highest val/success_once and its step, which then
    # marks checkpoints/best (`best`)
    best_val_success_once: float = -1.0
    best_val_step: int = -1
    actor_generation: int = 0  # the multi-rank actor's process-group generation (bumped on every rebuild)
    # the data the run reads from outside its run dir, key -> fingerprint (`input_fingerprints`): sft.store,
    # policy.model_path; recorded at the start, compared on every resume (a change is refused)
    inputs: dict = field(default_factory=dict)

    def best(self, val: bool) -> tuple[int, float, str]:
        """(step, value, metric) of the eval that chooses `checkpoints/best`: the validation split's best with `val`
        (env.eval.val_episodes > 0), else the eval's; step -1 before any eval."""
        if val:
            return self.best_val_step, self.best_val_success_once, "val/success_once"
        return self.best_eval_step, self.best_eval_success_once, "eval/success_once"


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    mlflow_run_id: str
    tracking_uri: str
    store_path: Path | None
    steps: int
    env_steps: int
    wall_s: float
    last_eval: dict
    peak_rss_gb: float
    interrupted: str | None = None  # the stop request (e.g. "SIGINT") that ended the run early, with a checkpoint


@dataclass
class Resume:
    """What `resolve_resume` found: the RunState saved in `checkpoint` (a path; None: a new run), the MLflow params
    to log and, on resume, the `runner.*`/`cluster.*`/`tracking.*` values that differ from the resumed run."""

    state: RunState
    checkpoint: Path | None
    params: dict
    changed: dict


def new_run_id() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def tracking_uri(cfg: Config) -> str:
    """The run's MLflow tracking URI: `tracking.uri`, else the default under `run_root`."""
    return cfg.tracking.uri or default_tracking_uri(Path(cfg.run_root).resolve())


def trajectory_fields(cfg: Config, obs_dim: int, action_dim: int) -> dict[str, FieldSpec]:
    """The zarr schema of a training run's store: the stored fields of tasks.trajectory under this config."""
    return trajectory.zarr_schema(trajectory.Dims.from_config(cfg, obs_dim, action_dim))


def resolve_resume(cfg: Config) -> Resume:
    """Answer `runner.resume` without a cluster: a new RunState (resume unset), or the one of the resumed run's
    newest complete checkpoint (`latest`: the most recently STARTED run of the experiment, never an older one).

    Raises:
        ConfigError: `runner.resume` names no run, or a run another live driver owns (`storage.rundir.run_owner`:
            its pid, host, since when, command), the run has no complete checkpoint, its step is above
            `runner.max_steps`, `env.num_shards` differs from the checkpoint's, the checkpoint's MLflow run is not
            in `tracking.uri`'s store, or a key that shapes training differs from the resumed run's MLflow params
            (`run_params`).
    """
    resume = cfg.runner.resume
    if resume is None:
        state = RunState(run_id=new_run_id(), cursors=[None] * cfg.env.num_shards, inputs=input_fingerprints(cfg))
        return Resume(state, None, flatten_config(to_dict(cfg)), {})
    root = Path(cfg.run_root).resolve()
    exp_dir = root / cfg.experiment
    if resume == "latest":
        run_dir = latest_started_run(exp_dir)
        if run_dir is None:
            raise ConfigError("runner.resume", resume, f"no run of experiment {cfg.experiment} under "
                                                       f"{exp_dir}; start one without runner.resume")
        owner = run_owner(run_dir)
        if owner is not None:  # `latest` is the newest run; one that is live is not taken, nor an older one instead
            raise ConfigError("runner.resume", resume, f"the most recently started run of experiment "
                                                       f"{cfg.experiment} is live: {owner}")
        if latest_checkpoint(run_dir) is None:
            raise ConfigError("runner.resume", resume,
                              f"the most recently started run of experiment {cfg.experiment}, {run_dir.name} "
                              f"({run_dir}), has no complete checkpoint (it ended before its first one); "
                              f"start a new run, or resume an older run by its id (runner.resume=<run_id>)")
    else:
        try:
            run_dir = find_run_dir(root, resume)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError("runner.resume", resume, str(exc)) from None
    owner = run_owner(run_dir)  # a run another driver trains: never resumed beside it (nor read while it writes)
    if owner is not None:
        raise ConfigError("runner.resume", resume, owner)
    ckpt_path = latest_checkpoint(run_dir)
    if ckpt_path is None:
        raise ConfigError("runner.resume", resume, f"{run_dir} has no complete checkpoint to resume from")
    _check_intact(resume, run_dir, ckpt_path)
    state = RunState(**load_checkpoint(ckpt_path, keys=("run",))["run"]["runner"])
    _check_eval_records(resume, run_dir, state.step)
    state.inputs = _check_inputs(cfg, state)
    if len(state.cursors) != cfg.env.num_shards:
        raise ConfigError("env.num_shards", cfg.env.num_shards,
                          f"the checkpoint has {len(state.cursors)} shards; resume with the same env layout")
    if state.step > cfg.runner.max_steps:  # training cannot go back: the loop would only eval and re-save step N
        raise ConfigError("runner.max_steps", cfg.runner.max_steps,
                          f"the checkpoint of run {state.run_id} is at step {state.step} already ({ckpt_path}); "
                          f"set runner.max_steps above {state.step} to train on, or evaluate that checkpoint with "
                          f"python -m pipelines.eval {ckpt_path}")
    if state.step == cfg.runner.max_steps and _final_eval_recorded(run_dir, state.step):
        raise ConfigError("runner.max_steps", cfg.runner.max_steps,
                          f"run {state.run_id} is complete already: its checkpoint is at step {state.step} "
                          f"({ckpt_path}) and its final eval is recorded, so the resume would train nothing; set "
                          f"runner.max_steps above {state.step} to train on, or evaluate that checkpoint with "
                          f"python -m pipelines.eval {ckpt_path}")
    params, changed = run_params(cfg, state.mlflow_run_id, tracking_uri(cfg))
    return Resume(state, Path(ckpt_path), params, changed)


def _final_eval_recorded(run_dir: Path, step: int) -> bool:
    """Whether the run in `run_dir` recorded an eval at `step` (`<run_dir>/evals/step_<step>.json`, and the
    validation split's too when the run has one): at `runner.max_steps` that is its final eval (Runner._finish_run),
    so a resume there would do nothing."""
    from tasks.evalstats import read_evals
    if step not in read_evals(run_dir):
        return False
    val = read_evals(run_dir, split="val")
    return not val or step in val


def input_fingerprints(cfg: Config) -> dict[str, str]:
    """Fingerprints of the data a run reads from outside its run dir, by config key: `sft.store` (SFT: the
    recording it trains on, `TrajectoryStore.fingerprint`: store id, complete steps, layout and attributes; no field
    data read) and `policy.model_path` (the weights it starts from, `storage.checkpoints.directory_fingerprint`).
    Keys that are unset, or whose path is missing (the config checks name that), are left out.

    Raises:
        ConfigError: (sft.store) the store's metadata or step bookkeeping is damaged.
    """
    from storage.checkpoints import directory_fingerprint
    from storage.trajectories import DamagedStore
    out = {}
    if cfg.algorithm.name == "sft" and cfg.sft.store and Path(cfg.sft.store).is_dir():
        try:
            out["sft.store"] = TrajectoryStore.open(cfg.sft.store).fingerprint()
        except DamagedStore as exc:
            raise ConfigError("sft.store", cfg.sft.store, str(exc).split(": ", 1)[-1]) from None
    if cfg.policy.model_path and Path(cfg.policy.model_path).is_dir():
        out["policy.model_path"] = directory_fingerprint(cfg.policy.model_path)
    return out


def _check_inputs(cfg: Config, state: RunState) -> dict[str, str]:
    """On resume: the fingerprints of the data the run reads from outside its run dir (`input_fingerprints`)
    against those its checkpoint recorded. Returns the fingerprints to record from now on (a checkpoint written
    before they were recorded adopts today's).

    Raises:
        ConfigError: (the key) the path holds other data than the run trained on so far (re-recorded, retrained,
            replaced): names the recorded and the found fingerprint and the fix.
    """
    found = input_fingerprints(cfg)
    for key, was in state.inputs.items():
        now = found.get(key)
        if now is not None and now != was:
            value = cfg.sft.store if key == "sft.store" else cfg.policy.model_path
            what = "recording" if key == "sft.store" else "weights"
            raise ConfigError(key, value, f"holds other data than run {state.run_id} trained on until step "
                                          f"{state.step} (recorded: {was}; found: {now}); a resume must read the "
                                          f"same {what}: put {'it' if key == 'sft.store' else 'them'} back at this "
                                          f"path, or start a new run (without "
                                          f"runner.resume) to train on the new {what}")
    return {**state.inputs, **found}


def _check_eval_records(resume: str, run_dir: Path, step: int) -> None:
    """Read the eval records the resumed run keeps (steps <= its checkpoint's `step`, both splits; later ones are
    superseded and removed) before anything starts: its baseline, best and regression decisions read them.

    Raises:
        ConfigError: (runner.resume) a record is damaged; the message names the file and the fix.
    """
    from tasks.evalstats import DamagedEvalRecord, read_evals
    try:
        for split in ("eval", "val"):
            read_evals(run_dir, split, upto=step)
    except DamagedEvalRecord as exc:
        raise ConfigError("runner.resume", resume, str(exc)) from None


def _check_intact(resume: str, run_dir: Path, ckpt_path: Path) -> None:
    """Verify every file of the checkpoint a resume will load (sha256 against its index) before anything is
    started or written: a damaged file is found here, not by the actor after the MLflow run was forked and the
    store grown.

    Raises:
        ConfigError: a file is missing or damaged; the message names it and the newest intact older checkpoint
            the resume would start from once the damaged one is moved aside.
    """
    from storage.checkpoints import checkpoint_damage, checkpoint_step, intact_before

    why = checkpoint_damage(ckpt_path)
    if why:
        older = intact_before(run_dir, checkpoint_step(ckpt_path))
        fix = (f"move it aside (mv {ckpt_path} {ckpt_path}.damaged) and the same command resumes from "
               f"{older.name}, the newest intact checkpoint" if older is not None else
               "no older checkpoint of this run is intact: start a new run")
        raise ConfigError("runner.resume", resume, f"{why}; {fix}")


def run_params(cfg: Config, mlflow_run_id: str | None, uri: str) -> tuple[dict, dict]:
    """MLflow params (the flattened resolved config) and, on resume (`mlflow_run_id` given), the `runner.*`/
    `cluster.*`/`tracking.*` values that differ from the resumed run (MLflow params are immutable: these go to an
    artifact instead).

    Raises:
        ConfigError: the resumed MLflow run is not in the tracking store, or a key that shapes training (env,
            policy, algorithm, rollout, ...) differs.
    """
    flat = flatten_config(to_dict(cfg))
    if mlflow_run_id is None:
        return flat, {}
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    try:
        existing = MlflowClient(uri).get_run(mlflow_run_id).data.params
    except MlflowException:
        raise ConfigError("tracking.uri", uri, f"the checkpoint's MLflow run {mlflow_run_id} is not in "
                                               f"this tracking store; resume with the run's tracking.uri") from None
    changed = {k: v for k, v in flat.items() if k in existing and existing[k] != str(v)[:6000]}
    for k in changed:
        if not k.startswith(("runner.", "cluster.", "tracking.")):
            raise ConfigError(k, flat[k], f"differs from the resumed run ({existing[k]!r}); resume with the "
                                         f"same training config or start a new run")
    return {k: v for k, v in flat.items() if k not in changed}, changed


class Setup:
    """Run set-up steps of `pipelines.runner.Runner` (see the module docstring)."""

    def _start_or_resume(self) -> tuple[RunState, dict | None, Resume]:
        """The RunState to start from and the checkpoint to restore ({"path"}; None: a new run)."""
        res = resolve_resume(self.cfg)
        if res.checkpoint is None:
            return res.state, None, res
        self.echo(f"resuming run {res.state.run_id} from {res.checkpoint} (step {res.state.step})")
        if res.state.step >= self.cfg.runner.max_steps:
            self.echo(f"the checkpoint is at runner.max_steps={self.cfg.runner.max_steps} already: no training "
                      f"step; only the final eval and checkpoint run again (raise runner.max_steps to train on)")
        return res.state, {"path": str(res.checkpoint)}, res

    def _hold_run_dir(self, run_lock=None) -> None:
        """Own the run directory before anything is written into it (`storage.rundir.lock_run_dir`: one live driver
        per run; a dead driver's lock is taken over with a note) and, for SFT, hold `sft.store` shared so that no
        recording writes it while this run reads it. `run_lock`: the run dir's lock the command took already
        (pipelines.run, before its cluster starts); it stays the command's to release. Released by
        `_release_run_dir` at the end of `run()` (or of a failed constructor).

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
        if self.cfg.algorithm.name == "sft" and self.cfg.sft.store:
            try:
                self._locks.append(lock_store(self.cfg.sft.store, shared=True))
            except LockBusy as exc:
                self._release_run_dir()
                raise ConfigError("sft.store", self.cfg.sft.store, str(exc)) from None

    def _release_run_dir(self) -> None:
        """Release the locks `_hold_run_dir` took (idempotent)."""
        for lock in getattr(self, "_locks", []):
            lock.release()
        self._locks = []

    def _params(self, uri: str) -> tuple[dict, dict]:
        """`run_params` of this run (see there)."""
        return run_params(self.cfg, self.state.mlflow_run_id, uri)

    def _open_run(self) -> None:
        """The run dir with the resolved config, and the run's MLflow Tracker (nothing logged yet)."""
        cfg = self.cfg
        uri = tracking_uri(cfg)
        self.run_dir = new_run_dir(self.root, cfg.experiment, self.state.run_id)
        self._run_dir_id = dir_identity(self.run_dir)  # Runner._run_dir_gone: removed or replaced under the run
        write_resolved_config(self.run_dir, to_yaml(cfg))
        self._one_timeline_on_disk()  # a resume: evals after its step go, the best pointer follows its state
        self.tracker = Tracker(uri=uri, experiment=cfg.tracking.experiment or cfg.experiment,
                               run_name=self.state.run_id)
        self.tracking_uri = uri

    def _log_run(self, resume: Resume) -> None:
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

    def _open_store(self, dims) -> TrajectoryStore | None:
        """The run's trajectory store (None: not saved, or SFT); a resume marks its later steps superseded."""
        cfg = self.cfg
        if not cfg.storage.save_trajectories or cfg.algorithm.name == "sft":
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
        return store

    @property
    def ranks(self) -> int:
        """Actor ranks: 1 (`tasks.update.actor_update`) or R > 1 (`tasks.distributed`, one process group)."""
        return self.cfg.algorithm.num_actor_ranks

    def _init_actor(self, ckpt: dict | None, tag: str = ""):
        """Run the init graph; returns (weights future, dims). With R > 1 also sets `self.actor_weights` (the
        weights the ranks build their group from) and `self.group` (rank 0's host and a free port there)."""
        init = graphs.build_init(self.cfg, run_id=self.state.run_id, placement=self.placement,
                                 checkpoint_path=ckpt["path"] if ckpt else None, tag=tag)
        if self.ranks == 1:
            dims_f, w_f = self.client.get(init.graph, [init.dims, init.weights], sync=False)
            return w_f, self._result([dims_f], "the init graph")[0]  # watched: no silent wait (recovery)
        dims_f, w_f, full_f, port_f = self.client.get(
            init.graph, [init.dims, init.weights, init.actor_weights, init.port], sync=False)
        self.actor_weights = full_f
        dims, port = self._result([dims_f, port_f], "the init graph")
        self.group = {"master_addr": _host(self.placement.actor_workers[0]), "master_port": int(port)}
        return w_f, dims

    def _group_specs(self) -> list[dict] | None:
        """Each rank's process-group spec of the current generation (None with one rank)."""
        if self.ranks == 1:
            return None
        from tasks.distributed import group_specs
        return group_specs(self.ranks, self.group["master_addr"], self.group["master_port"],
                           self.state.actor_generation)

    # ----- one timeline (resume, rollback) -----
    _NOT_ROLLED_BACK = ("run_id", "mlflow_run_id", "elapsed_s", "actor_generation")

    @property
    def _has_val(self) -> bool:
        """A validation split (env.eval.val_episodes > 0) chooses checkpoints/best (`RunState.best`)."""
        return self.cfg.env.eval.val_episodes > 0

    def _one_timeline_on_disk(self) -> None:
        """After the state was set to step k (a new run, a resume, a rollback): the eval records of steps > k
        (`<run_dir>/evals/`, both splits, a superseded timeline) are removed and the best-checkpoint pointer is made
        to agree with the state's best eval (`RunState.best`; `storage.checkpoints.sync_best`: its checkpoint if
        complete, else no pointer), so a best set after k never survives."""
        st = self.state
        discard_evals_after(self.run_dir, st.step)
        sync_best(self.run_dir, *st.best(self._has_val))

    def _rollback(self, ckpt) -> None:
        """Roll the run back to checkpoint `ckpt` (a path; None: to a fresh start at step 0), e.g. after the
        actor's worker was lost (its weights and optimizer with it).

        Restores every RunState field that describes training progress from the checkpoint's runner meta (step,
        env_steps, env cursors, best eval, and any field added later; not run_id, the MLflow run, the wall time
        spent, the actor group generation), marks the store's steps >= the restored step incomplete
        (`TrajectoryStore.invalidate_from`) and continues MLflow in a new run holding the points with step <= the
        restored step (`Tracker.fork`; the old run is soft-deleted), and drops the eval records after it and a best
        pointer beyond it (`_one_timeline_on_disk`), so every reader sees one timeline; the progress bar is set back
        to the restored step and the perf events record the rollback. The actor itself is not touched: the caller re-runs the init graph from the same checkpoint (`_init_actor`).
        """
        st = self.state
        if ckpt is not None:
            saved = RunState(**load_checkpoint(ckpt, keys=("run",))["run"]["runner"])
        else:
            saved = RunState(run_id=st.run_id, cursors=[None] * self.cfg.env.num_shards)
        for f in fields(RunState):
            if f.name not in self._NOT_ROLLED_BACK:
                setattr(st, f.name, getattr(saved, f.name))
        if self.store is not None:
            self._flush_complete()  # a step finished before the loss is marked first, then invalidated if rolled back
            self.store.invalidate_from(st.step)
        self._one_timeline_on_disk()
        st.mlflow_run_id = self.tracker.fork(st.step, reason=f"rollback to {'step %d' % st.step if ckpt else 'start'}")
        bar = getattr(self, "_bar", None)
        if bar is not None:  # the progress bar follows the run back
            bar.n = st.step
            bar.refresh()
        perf = getattr(self, "perf", None)
        if perf is not None:
            perf.rollback(st.step)
        self.echo(f"dagrl: rolled back to {ckpt or 'a fresh actor (no checkpoint yet)'} (step {st.step}); MLflow "
                  f"continues in run {st.mlflow_run_id}")
