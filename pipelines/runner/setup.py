"""Run set-up, offline: run ids, the RunState a run continues from, and resume.

`resolve_resume(cfg)` answers `runner.resume` OFFLINE (no cluster, no worker): which run, which checkpoint, whether
its shard layout and training keys match this config; `pipelines.run` calls it before the cluster starts and the
`Runner` again when it starts, so a bad resume is one line and exit 2, and nothing is written. The run's files
themselves (run dir, lock, MLflow run, store, the one timeline) are `pipelines.runner.context.RunContext`'s.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from pipelines.config import to_dict
from storage.checkpoints import latest_checkpoint, load_checkpoint
from storage.rundir import find_run_dir, latest_started_run, run_owner
from storage.tracking import default_tracking_uri, flatten_config
from storage.trajectories import FieldSpec, TrajectoryStore
from tasks import trajectory
from tasks.config import Config, ConfigError


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


def learns_from_rollouts(cfg: Config) -> bool:
    """Whether the run's algorithm trains on its own rollouts (the algorithm's spec, `AlgorithmConfig.spec.rollout`),
    else on a recording (`sft.store`: no env steps, no trajectory store, steps of `graphs.build_sft_step`)."""
    return bool(cfg.algorithm.spec.rollout)


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
            (`run_params`); the checkpoint, its store or eval records of an older format (one line naming the file
            and `python -m pipelines.upgrade RUN_DIR`).
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
    runner = load_checkpoint(ckpt_path, keys=("run",))["run"]["runner"]
    _check_recorded_inputs(resume, ckpt_path, runner)
    state = RunState(**runner)
    _check_formats(resume, run_dir, ckpt_path, state)
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


def _check_formats(resume: str, run_dir: Path, ckpt_path: Path, state: RunState) -> None:
    """On resume: the env shard cursors of the checkpoint and the run's trajectory store are of today's format.

    Raises:
        ConfigError(runner.resume): one of an older format; one line naming the file and `python -m
            pipelines.upgrade RUN_DIR` (the checkpoint and config formats are checked where they are read)."""
    from pipelines.saved_config import refusal
    from pipelines.upgrade.store import STORE_DIR, store_refusal
    from tasks.envs.shard import is_cursor
    old = [s for s, c in enumerate(state.cursors) if c is not None and not is_cursor(c)]
    if old:
        raise ConfigError("runner.resume", resume, refusal(ckpt_path / "meta.json",
                                                           f"env shard cursors of shards {old}"))
    if (run_dir / STORE_DIR / "zarr.json").is_file():
        line = store_refusal(run_dir / STORE_DIR)
        if line is not None:
            raise ConfigError("runner.resume", resume, line)


def _check_recorded_inputs(resume: str, ckpt_path: Path, runner: dict) -> None:
    """On resume: the checkpoint's runner state (`runner`, its saved RunState fields) records the fingerprints of
    the run's outside inputs (`RunState.inputs`; {} for a run that reads none), so `_check_inputs` has something to
    compare.

    Raises:
        ConfigError(runner.resume): a checkpoint written before they were recorded (no `inputs` key); one line
            naming its meta.json and `python -m pipelines.upgrade RUN_DIR` (which records today's)."""
    from pipelines.saved_config import refusal
    from pipelines.upgrade.checkpoints import NO_INPUTS, no_inputs
    if no_inputs({"runner": runner}):
        raise ConfigError("runner.resume", resume, refusal(ckpt_path / "meta.json", NO_INPUTS))


def _final_eval_recorded(run_dir: Path, step: int) -> bool:
    """Whether the run in `run_dir` recorded an eval at `step` (`<run_dir>/evals/step_<step>.json`, and the
    validation split's too when the run has one): at `runner.max_steps` that is its final eval (Runner._finish_run),
    so a resume there would do nothing."""
    from tasks.evalstats import read_evals
    if step not in read_evals(run_dir):
        return False
    val = read_evals(run_dir, split="val")
    return not val or step in val


def input_paths(cfg: Config) -> dict[str, str]:
    """The data a run reads from outside its run dir, config key -> path: `sft.store` (an algorithm that trains on a
    recording) and `policy.model_path`; unset keys left out."""
    out = {}
    if not learns_from_rollouts(cfg) and cfg.sft.store:
        out["sft.store"] = str(cfg.sft.store)
    if cfg.policy.model_path:
        out["policy.model_path"] = str(cfg.policy.model_path)
    return out


def input_fingerprints(cfg: Config) -> dict[str, str]:
    """Fingerprints of the data a run reads from outside its run dir (`input_paths`), by config key: `sft.store`
    (the recording it trains on, `TrajectoryStore.fingerprint`: store id, complete steps, layout and attributes; no
    field data read) and `policy.model_path` (the weights it starts from, `storage.exports.directory_fingerprint`).
    Keys whose path is missing (the config checks name that) are left out.

    Raises:
        ConfigError: (sft.store) the store's metadata or step bookkeeping is damaged.
    """
    from storage.exports import directory_fingerprint
    from storage.trajectories import DamagedStore
    out = {}
    for key, path in input_paths(cfg).items():
        if not Path(path).is_dir():
            continue
        if key == "sft.store":
            try:
                out[key] = TrajectoryStore.open(path).fingerprint()
            except DamagedStore as exc:
                raise ConfigError(key, path, str(exc).split(": ", 1)[-1]) from None
        else:
            out[key] = directory_fingerprint(path)
    return out


def _check_inputs(cfg: Config, state: RunState) -> dict[str, str]:
    """On resume: the fingerprints of the data the run reads from outside its run dir (`input_fingerprints`)
    against those its checkpoint recorded (`_check_recorded_inputs`: it has them). Returns the fingerprints to
    record from now on: the recorded ones, and today's of a key the run did not read before.

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
        ConfigError: (runner.resume) a record is damaged, or of an older format (no eval_layout); the message
            names the file and the fix.
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
