"""The training loop: weight versions, one graph per step, eval, checkpoints, metrics, resume.

Only this module and pipelines.run hold a Dask client. Per step: reserve the store's step, build and submit the
step graph, wait for `step_metrics` and the store writes, mark the step complete, log one MLflow batch, advance
the progress bar; every `val_check_interval` steps an eval graph; every `save_interval` steps a checkpoint.

Asynchronous steps (`runner.max_staleness` = k > 0): the runner keeps up to k step graphs submitted ahead of the one
it waits for. Step j's rollout takes the weights of step j-k (`v(j-k)`: the rollout of step n+1 runs on v(n) while
update n runs; the newest weights when nothing is in flight), its update the previous update's output, its first env nodes follow step j-1's last ones; the actor
corrects with decoupled PPO (tasks.update.actor_update). Nothing is submitted ahead across a step after which an
eval or a checkpoint follows, nor beyond `max_steps`/`max_env_steps`: an eval or checkpoint always sees a drained
pipeline, so a checkpoint holds exactly what a synchronous one does (a resumed run refills the pipeline from v(n)).
A run stopped by `max_wall_time_s` finishes the steps already in flight. A lost worker cancels every step in
flight and takes the synchronous retry path (`_recover`); the pipeline then refills from the current weights.

Resume and interruption: a resume (`runner.resume=RUN_ID|latest`: the most recently started run of the experiment,
an error naming it when it has no checkpoint) restores the RunState from the newest checkpoint; with the cursors
(open episodes, per-shard RNG), the actor's weights, optimizer and process RNG in the checkpoint, the resumed run
equals the uninterrupted one step for step. `request_stop` (pipelines.run: the first SIGINT/SIGTERM) ends the loop
after the step(s) in flight with a checkpoint of the current step.

One timeline: a redone step never shows twice. A resume or a rollback (`_rollback`, after a lost actor) to step k
marks the store's steps >= k incomplete (each redone step is a new attempt, complete only once every shard wrote
it) and continues MLflow in a NEW run holding a copy of every point with step <= k (`Tracker.continue_from` /
`Tracker.fork`; MLflow's client cannot delete single points); the superseded run is tagged `dagrl.superseded_by`
and soft-deleted. Metrics of a step are logged before its checkpoint, so the run a checkpoint records holds them.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from pipelines import graphs
from pipelines.cluster import ClusterHandle, Placement, _host, cluster_rss_bytes, plan_placement
from pipelines.config import to_dict, to_yaml
from pipelines.recovery import Recovery
from storage.checkpoints import latest_checkpoint, load_checkpoint, prune_checkpoints
from storage.rundir import find_run_dir, latest_started_run, new_run_dir, write_resolved_config
from storage.tracking import Tracker, default_tracking_uri, flatten_config
from storage.trajectories import FieldSpec, TrajectoryStore
from tasks.config import Config, ConfigError
from tasks.rollout import group_size, num_values
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
    best_eval_success_once: float = -1.0
    best_eval_step: int = -1
    actor_generation: int = 0  # the multi-rank actor's process-group generation (bumped on every rebuild)


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


def new_run_id() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def trajectory_fields(cfg: Config, obs_dim: int, action_dim: int) -> dict[str, FieldSpec]:
    """The zarr schema of a rollout: trailing dims after [T, B] and dtypes (tasks.rollout STEP_FIELDS)."""
    C, V = cfg.policy.num_action_chunks, num_values(cfg)
    return {"obs": FieldSpec((obs_dim,), "float32"), "actions": FieldSpec((C, action_dim), "float32"),
            "logprobs": FieldSpec((C, action_dim), "float32"), "values": FieldSpec((V,), "float32"),
            "final_values": FieldSpec((V,), "float32"), "rewards": FieldSpec((C,), "float32"),
            "terminated": FieldSpec((), "bool"), "truncated": FieldSpec((), "bool"),
            "step_mask": FieldSpec((C,), "bool"), "success": FieldSpec((), "bool"),
            "episode_seed": FieldSpec((), "int64"), "episode_id": FieldSpec((), "int64"),
            **({"rgb": FieldSpec((cfg.env.image_size, cfg.env.image_size, 3), "uint8")}
               if cfg.env.obs_mode == "rgb" else {})}


class Runner(Recovery):
    """Drives one experiment on a connected cluster. `run()` returns a RunResult."""

    def __init__(self, cfg: Config, handle: ClusterHandle, *, echo=print):
        self.cfg, self.handle, self.client, self.echo = cfg, handle, handle.client, echo
        self.root = Path(cfg.run_root).resolve()
        self.placement: Placement = plan_placement(cfg, self.client)
        self._placed_ids = self._worker_ids()
        self.state, ckpt = self._start_or_resume()
        self.group: dict | None = None  # multi-rank actor: {"master_addr", "master_port"} of the current generation
        self.actor_weights = None  # what the ranks take as weights: the init's (to build from), then {"version"}
        if ckpt is not None and self.ranks > 1:  # a resumed run: drop groups a previous driver left on the workers
            self._release_groups(self.placement.actor_workers[:self.ranks])
            self.state.actor_generation += 1
        uri = cfg.tracking.uri or default_tracking_uri(self.root)
        params, changed = self._params(uri)  # on resume: refuses a changed training key before writing anything
        self.run_dir = new_run_dir(self.root, cfg.experiment, self.state.run_id)
        write_resolved_config(self.run_dir, to_yaml(cfg))
        # a resume continues in a new MLflow run holding the checkpoint's timeline (Tracker.continue_from)
        self.tracker = Tracker(uri=uri, experiment=cfg.tracking.experiment or cfg.experiment,
                               run_name=self.state.run_id)
        self.tracking_uri = uri
        try:  # an interrupt or error while setting up must not leave the MLflow run RUNNING
            if self.state.mlflow_run_id is not None:
                self.tracker.continue_from(self.state.mlflow_run_id, self.state.step, reason="resume")
            self.state.mlflow_run_id = self.tracker.run_id
            self.tracker.log_params({**params, **changed})
            if changed:
                self.tracker.log_text("".join(f"{k}: {v}\n" for k, v in changed.items()),
                                      f"resumes/step_{self.state.step}.yaml")
            self.tracker.log_artifact(self.run_dir / "config.yaml")
            self.weights, dims = self._init_actor(
                ckpt, tag=f"g{self.state.actor_generation}" if self.ranks > 1 else "")
            self.dims = tuple(dims)
            self.store = None
            if cfg.storage.save_trajectories and cfg.algorithm.name != "sft":
                self.store = TrajectoryStore.create(
                    self.run_dir / "trajectories.zarr", fields=trajectory_fields(cfg, *dims), T=cfg.rollout.chunk_steps,
                    num_envs=cfg.env.num_envs, shard_size=cfg.env.shard_size,
                    attrs={"run_id": self.state.run_id, "env_id": cfg.env.env_id, "simulator": cfg.env.simulator,
                           "obs_mode": cfg.env.obs_mode, "control_mode": cfg.env.control_mode,
                           "reward_mode": cfg.env.reward_mode, "base_seed": cfg.env.seed,
                           "sim_backend": cfg.env.sim_backend, "auto_reset": cfg.env.auto_reset,
                           "ignore_terminations": cfg.env.ignore_terminations,
                           "seed_rule": TRAIN_SEED_RULE, "group_size": group_size(cfg),
                           "num_action_chunks": cfg.policy.num_action_chunks,
                           "max_episode_steps": cfg.env.max_episode_steps})
                self.store.invalidate_from(self.state.step)  # a resume: later steps are a superseded timeline
            self.peak_rss = 0
            self.last_eval: dict = {}
            self._ahead: list[tuple[int, object, list]] = []  # async: submitted steps (step, graph, futures), in order
            self._stopping = False  # async: submit nothing more (the run is done; in-flight steps drain)
            self._tags = 0  # async: graphs built since the start (a run-wide unique retry tag after a recovery)
            self.stop_requested: str | None = None  # request_stop(): end after the step in flight, checkpointed
            self.after_step = None  # optional hook(runner) called after each step is accounted (tests, tools)
            self._reset_pipeline()
        except BaseException as exc:
            self.tracker.set_terminated("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise

    # ----- set-up -----
    def _start_or_resume(self) -> tuple[RunState, dict | None]:
        resume = self.cfg.runner.resume
        if resume is None:
            return RunState(run_id=new_run_id(), cursors=[None] * self.cfg.env.num_shards), None
        exp_dir = self.root / self.cfg.experiment
        if resume == "latest":  # the most recently STARTED run of the experiment, never an older one
            run_dir = latest_started_run(exp_dir)
            if run_dir is None:
                raise ConfigError("runner.resume", resume, f"no run of experiment {self.cfg.experiment} under "
                                                           f"{exp_dir}; start one without runner.resume")
            if latest_checkpoint(run_dir) is None:
                raise ConfigError("runner.resume", resume,
                                  f"the most recently started run of experiment {self.cfg.experiment}, {run_dir.name} "
                                  f"({run_dir}), has no complete checkpoint (it ended before its first one); "
                                  f"start a new run, or resume an older run by its id (runner.resume=<run_id>)")
        else:
            try:
                run_dir = find_run_dir(self.root, resume)
            except (FileNotFoundError, ValueError) as exc:
                raise ConfigError("runner.resume", resume, str(exc)) from None
        ckpt_path = latest_checkpoint(run_dir)
        if ckpt_path is None:
            raise ConfigError("runner.resume", resume, f"{run_dir} has no complete checkpoint to resume from")
        meta = load_checkpoint(ckpt_path, keys=("run",))["run"]
        st = meta["runner"]
        state = RunState(**st)
        if len(state.cursors) != self.cfg.env.num_shards:
            raise ConfigError("env.num_shards", self.cfg.env.num_shards,
                              f"the checkpoint has {len(state.cursors)} shards; resume with the same env layout")
        self.echo(f"resuming run {state.run_id} from {ckpt_path} (step {state.step})")
        return state, {"path": str(ckpt_path)}

    def _params(self, uri: str) -> tuple[dict, dict]:
        """MLflow params (the flattened resolved config) and, on resume, the `runner.*`/`cluster.*`/`tracking.*`
        values that differ from the resumed run (MLflow params are immutable: these go to an artifact instead).

        Raises:
            ConfigError: on resume, a key that shapes training (env, policy, algorithm, rollout, ...) differs.
        """
        flat = flatten_config(to_dict(self.cfg))
        if self.state.mlflow_run_id is None:
            return flat, {}
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        try:
            existing = MlflowClient(uri).get_run(self.state.mlflow_run_id).data.params
        except MlflowException:
            raise ConfigError("tracking.uri", uri, f"the checkpoint's MLflow run {self.state.mlflow_run_id} is not in "
                                                   f"this tracking store; resume with the run's tracking.uri") from None
        changed = {k: v for k, v in flat.items() if k in existing and existing[k] != str(v)[:6000]}
        for k in changed:
            if not k.startswith(("runner.", "cluster.", "tracking.")):
                raise ConfigError(k, flat[k], f"differs from the resumed run ({existing[k]!r}); resume with the "
                                             f"same training config or start a new run")
        return {k: v for k, v in flat.items() if k not in changed}, changed

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
            return w_f, self._result([dims_f], "the init graph")[0]  # watched: no silent wait (pipelines.recovery)
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

    def _rollback(self, ckpt) -> None:
        """Roll the run back to checkpoint `ckpt` (a path; None: to a fresh start at step 0), e.g. after the
        actor's worker was lost (its weights and optimizer with it).

        Restores every RunState field that describes training progress from the checkpoint's runner meta (step,
        env_steps, env cursors, best eval, and any field added later; not run_id, the MLflow run, the wall time
        spent, the actor group generation), marks the store's steps >= the restored step incomplete
        (`TrajectoryStore.invalidate_from`) and continues MLflow in a new run holding the points with step <= the
        restored step (`Tracker.fork`; the old run is soft-deleted), so every reader sees one timeline. The actor
        itself is not touched: the caller re-runs the init graph from the same checkpoint (`_init_actor`).
        """
        from dataclasses import fields
        st = self.state
        if ckpt is not None:
            saved = RunState(**load_checkpoint(ckpt, keys=("run",))["run"]["runner"])
        else:
            saved = RunState(run_id=st.run_id, cursors=[None] * self.cfg.env.num_shards)
        for f in fields(RunState):
            if f.name not in self._NOT_ROLLED_BACK:
                setattr(st, f.name, getattr(saved, f.name))
        if self.store is not None:
            self.store.invalidate_from(st.step)
        st.mlflow_run_id = self.tracker.fork(st.step, reason=f"rollback to {'step %d' % st.step if ckpt else 'start'}")
        self.echo(f"dagrl: rolled back to {ckpt or 'a fresh actor (no checkpoint yet)'} (step {st.step}); MLflow "
                  f"continues in run {st.mlflow_run_id}")

    # ----- the loop -----
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
        if r.stop_on_eval_success is not None and s.best_eval_success_once >= r.stop_on_eval_success:
            return True
        return False

    def sft_step(self) -> dict:
        """One behaviour-cloning step's graph (no env steps); lost workers are handled as for training steps."""
        st = self.state
        t0 = time.perf_counter()

        def build(attempt: int):
            graph, upd, met = graphs.build_sft_step(self.cfg, run_id=st.run_id, step=st.step, weights=self.weights,
                                                    placement=self.placement, attempt=attempt)
            return graph, [upd, met]

        (upd_f,), (m,) = self._compute(build, "SFT step", keep=1)
        self.weights = upd_f
        st.step += 1
        m["time/step"] = time.perf_counter() - t0
        self.peak_rss = max(self.peak_rss, cluster_rss_bytes())
        m["system/rss_total_gb"] = self.peak_rss / 2**30
        return m

    def train_step(self) -> dict:
        """Run one training step's graph; on a lost worker, recover and retry (up to `runner.max_retries`)."""
        if self.cfg.algorithm.name == "sft":
            return self.sft_step()
        if self.cfg.runner.max_staleness > 0:
            return self._train_step_async()
        cfg, st = self.cfg, self.state
        t0 = time.perf_counter()
        retries, step = 0, st.step

        def build(attempt: int):
            nonlocal retries, step
            retries, step = attempt, st.step  # a lost actor rolls st.step back to its checkpoint
            if self.store is not None:
                self.store.reserve(step)
            sg = graphs.build_train_step(cfg, run_id=st.run_id, step=step, weights=self.weights,
                                         cursors=st.cursors, placement=self.placement, dims=self.dims,
                                         store_path=str(self.store.path) if self.store is not None else None,
                                         attempt=attempt, group=self._group_specs(), actor_weights=self.actor_weights)
            return sg.graph, [sg.update, sg.metrics, *sg.stores]

        (upd_f,), (out, *store_out) = self._compute(build, "training step", keep=1)
        return self._finish_step(step, upd_f, out, store_out, retries, t0)

    def _finish_step(self, step: int, upd_f, out: dict, store_out: list, retries: int, t0: float) -> dict:
        """Account a finished training step: weights, store step, cursors, counters; return its metrics."""
        cfg, st = self.cfg, self.state
        version = int(out["metrics"]["train/weight_version"])
        if self.ranks > 1:  # the group lives on with the weights; a rebuild comes with a new init's weights
            self.actor_weights = {"version": version}
        if self.store is not None:
            behaviour = int(out["metrics"].get("train/behaviour_version", version - 1))
            self.store.mark_complete(step, weight_version=behaviour, global_step=step)
        self.weights = upd_f
        st.cursors = out["cursors"]
        env_steps = cfg.env.num_envs * cfg.rollout.chunk_steps * cfg.policy.num_action_chunks
        st.env_steps += env_steps
        st.step += 1
        wall = time.perf_counter() - t0
        m = out["metrics"]
        m["time/step"] = wall
        m["rollout/env_steps_per_s"] = env_steps / wall
        m["rollout/env_steps_total"] = float(st.env_steps)
        m["time/overhead_share"] = max(0.0, 1.0 - (m["time/rollout_total_max"] + m["time/update"]) / wall)
        if store_out:
            m["time/store_max"] = max(s["seconds"] for s in store_out)
            m["system/store_mb"] = sum(s["bytes"] for s in store_out) / 1e6
        self.peak_rss = max(self.peak_rss, cluster_rss_bytes())
        m["system/rss_total_gb"] = self.peak_rss / 2**30
        m["train/retries"] = float(retries)
        return m

    # ----- asynchronous steps (runner.max_staleness > 0) -----
    def _reset_pipeline(self) -> None:
        """Start the pipeline afresh from `self.weights` at the current step (start, resume, after a recovery)."""
        self._ahead = []
        self._w = {self.state.step: self.weights}  # step j -> the weights update j starts from (v(j))
        self._w_base = self.state.step
        self._after: list | None = None  # futures of the newest submitted step's last env nodes

    def _may_submit_ahead(self, j: int) -> bool:
        """Whether step j's graph may be submitted while step j-1's is still in flight."""
        r, st = self.cfg.runner, self.state
        per_step = self.cfg.env.num_envs * self.cfg.rollout.chunk_steps * self.cfg.policy.num_action_chunks
        return (not self._stopping and j < r.max_steps and j % r.val_check_interval != 0
                and j % r.save_interval != 0
                and (r.max_env_steps is None or st.env_steps + (j - st.step) * per_step < r.max_env_steps))

    def _submit_step(self) -> None:
        """Build and submit the next step's graph (j = current step + steps in flight)."""
        cfg, st = self.cfg, self.state
        j = st.step + len(self._ahead)
        if self.store is not None:
            self.store.reserve(j)
        # with nothing in flight the newest weights cost no waiting: a drained pipeline restarts on-policy
        behaviour = self._w[j] if not self._ahead else self._w[max(j - cfg.runner.max_staleness, self._w_base)]
        sg = graphs.build_train_step(
            cfg, run_id=st.run_id, step=j, weights=behaviour,
            cursors=st.cursors, placement=self.placement, dims=self.dims,
            store_path=str(self.store.path) if self.store is not None else None, attempt=self._tags,
            update_weights=self._w[j], after=self._after)
        futs = self.client.get(sg.graph, [sg.update, sg.metrics, *sg.stores, *sg.last_env], sync=False)
        n = 2 + len(sg.stores)
        self._w[j + 1] = futs[0]
        self._after = futs[n:]
        self._ahead.append((j, sg.graph, futs[:n]))

    def _cancel_pipeline(self) -> None:
        """Cancel every step in flight, newest first and one graph at a time: the scheduler cancels a key's
        dependents with it and asserts that someone wants each of them, so a step's outputs must go only after
        the later steps that depend on them (its update, its last env nodes) are gone. The last env nodes' futures
        are only dropped: their dependents are their own graph's inner nodes."""
        for _, _, futs in reversed(self._ahead):
            self._drop(futs)  # pipelines.recovery: release, not cancel (an inner node's assertion, see there)
        self._ahead, self._after = [], None

    def _train_step_async(self) -> dict:
        """Wait for the oldest step in flight, after topping the pipeline up to `max_staleness` steps ahead."""
        st, k = self.state, self.cfg.runner.max_staleness
        t0 = time.perf_counter()
        for attempt in range(self.cfg.runner.max_retries + 1):
            if not self._ahead:
                self._submit_step()
            while len(self._ahead) <= k and self._may_submit_ahead(st.step + len(self._ahead)):
                self._submit_step()
            step, graph, futs = self._ahead[0]
            lost = self._wait_or_lost(futs)
            if not lost:
                results = self._fetch_or_lost(futs[1:])
                if isinstance(results, list):
                    self._ahead.pop(0)
                    for old in [v for v in self._w if v < step + 1 - k]:  # weights no later rollout takes
                        del self._w[old]
                    out, *store_out = results
                    return self._finish_step(step, futs[0], out, store_out, attempt, t0)
                lost = results
            self._cancel_pipeline()  # every step in flight: the retry path starts from the current step
            if attempt < self.cfg.runner.max_retries:
                self._recover(lost, st.step)
                self._tags += 1
                self._reset_pipeline()
        raise RuntimeError(f"training step at step {st.step}: placed workers lost {self.cfg.runner.max_retries + 1} "
                           f"times; giving up (resume with runner.resume={st.run_id})")

    # ----- failures -----
    def _compute(self, build, what: str, keep: int = 0) -> tuple[list, list]:
        """Submit `build(attempt) -> (graph, keys)`, wait and fetch, watching the placed workers; after a loss,
        recover (`_recover`) and resubmit with new keys, up to `runner.max_retries` times.

        Returns (the first `keep` keys as futures, the results of the others). Results are fetched under the same
        watch: a result held by a worker that dies after finishing would otherwise be recomputed from pinned
        tasks that can no longer run, and the fetch would wait forever.
        """
        for attempt in range(self.cfg.runner.max_retries + 1):
            graph, keys = build(attempt)
            futs = self.client.get(graph, keys, sync=False)
            lost = self._wait_or_lost(futs)
            if not lost:
                results = self._fetch_or_lost(futs[keep:])
                if isinstance(results, list):
                    return futs[:keep], results
                lost = results
            busy = self._busy_rank_workers(graph)  # before cancelling: cancelled tasks leave the scheduler's view
            self._drop(futs)  # pipelines.recovery: release, not cancel (see there)
            if attempt < self.cfg.runner.max_retries:
                self._recover(lost, self.state.step, busy)
        raise RuntimeError(f"{what} at step {self.state.step}: placed workers lost {self.cfg.runner.max_retries + 1} "
                           f"times; giving up (resume with runner.resume={self.state.run_id})")

    def evaluate(self) -> dict:
        st = self.state
        t0 = time.perf_counter()
        _, parts = self._compute(lambda attempt: graphs.build_eval(
            self.cfg, run_id=st.run_id, step=st.step, weights=self.weights, placement=self.placement,
            attempt=attempt), "evaluation")
        episodes = [e for part in parts for e in part]
        m = {f"eval/{k}": float(np.mean([e[k] for e in episodes])) for k in
             ("success_once", "success_at_end", "return", "episode_len")}
        m["eval/num_episodes"] = float(len(episodes))
        m["time/eval"] = time.perf_counter() - t0
        if m["eval/success_once"] > st.best_eval_success_once:
            st.best_eval_success_once, st.best_eval_step = m["eval/success_once"], st.step
        m["eval/best_success_once"] = st.best_eval_success_once
        self.last_eval = m
        return m

    def checkpoint(self, elapsed: float) -> str:
        from dataclasses import asdict
        st = self.state
        if self._ahead:  # the actor would be read while a later update may run (see the module docstring)
            raise RuntimeError(f"checkpoint at step {st.step} with {len(self._ahead)} step(s) in flight")

        def build(attempt: int):
            meta = {"runner": {**asdict(st), "elapsed_s": elapsed}, "experiment": self.cfg.experiment}
            graph, key = graphs.build_checkpoint(run_id=st.run_id, step=st.step, run_dir=str(self.run_dir),
                                                 meta=meta, placement=self.placement, attempt=attempt, cfg=self.cfg,
                                                 group=self._group_specs(), weights=self.actor_weights,
                                                 dims=self.dims)
            return graph, [key]

        path = self._compute(build, "checkpoint")[1][0]
        prune_checkpoints(self.run_dir, self.cfg.runner.keep_checkpoints)
        return path

    def run(self) -> RunResult:
        cfg, st = self.cfg, self.state
        t_start = time.perf_counter()
        bar = None
        if cfg.runner.progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.runner.max_steps, initial=st.step, desc=cfg.experiment, unit="step",
                       dynamic_ncols=True)
        last_ckpt = None
        status = "FAILED"
        try:
            if cfg.runner.val_at_start and st.step == 0 and not self._eval_logged(0):
                self.tracker.log_metrics(self.evaluate(), step=0)
                self.echo(f"dagrl: eval before training: success_once {self.last_eval['eval/success_once']:.3f} "
                          f"over {self.last_eval['eval/num_episodes']:.0f} episodes")
            while True:
                self._stopping = self._done(t_start)
                if self._stopping and not self._ahead:  # async: steps in flight when the run is done still finish
                    break
                m = self.train_step()
                r = cfg.runner
                if st.step % r.val_check_interval == 0:
                    m.update(self.evaluate())
                # logged before the checkpoint: the MLflow run a checkpoint records holds every point through its
                # step, which is what a resume copies (Tracker.continue_from)
                self.tracker.log_metrics(m, step=st.step)
                if st.step % r.save_interval == 0:
                    last_ckpt = self.checkpoint(st.elapsed_s + time.perf_counter() - t_start)
                if self.after_step is not None:
                    self.after_step(self)
                if bar is not None:
                    bar.update(1)
                    post = {"env_sps": f"{m['rollout/env_steps_per_s']:.0f}",
                            "success": f"{m.get('env/success_once', float('nan')):.2f}"} \
                        if "rollout/env_steps_per_s" in m else {"loss": f"{m['train/sft_loss']:.3f}"}
                    if self.last_eval:
                        post["eval"] = f"{self.last_eval['eval/success_once']:.2f}"
                    bar.set_postfix(post)
            stopped = self.stop_requested
            if stopped is None and (not self.last_eval or st.step % cfg.runner.val_check_interval) \
                    and not self._eval_logged(st.step):  # a resume at the end: the kept timeline has it
                self.tracker.log_metrics(self.evaluate(), step=st.step)  # an interrupted run skips the final eval
            elapsed = st.elapsed_s + time.perf_counter() - t_start
            if last_ckpt is None or st.step % cfg.runner.save_interval:
                last_ckpt = self.checkpoint(elapsed)
            if stopped is not None:
                self.echo(f"dagrl: stopped ({stopped}) after step {st.step}: checkpoint {last_ckpt}; continue with "
                          f"runner.resume={st.run_id} (or runner.resume=latest)")
                status = "KILLED"
            else:
                self.tracker.log_text(str(last_ckpt), "final_checkpoint.txt")
                self.tracker.log_artifact(Path(last_ckpt), "final_checkpoint")
                status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            if bar is not None:
                bar.close()
            self.tracker.set_terminated(status)
        return RunResult(st.run_id, self.run_dir, self.tracker.run_id, self.tracking_uri,
                         self.store.path if self.store is not None else None, st.step, st.env_steps,
                         time.perf_counter() - t_start, self.last_eval, self.peak_rss / 2**30,
                         interrupted=self.stop_requested)
