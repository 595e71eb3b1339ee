"""The config schema: the section dataclasses, data only (their rules live in `tasks.config.checks`).

Hydra composes YAML (conf/config.yaml, the groups conf/{env,policy,algorithm,cluster,...}/ and an experiment
conf/conf/NAME.yaml); `pipelines.compose.to_config` (the one path of `pipelines.config.load_config` and of saved
run configs) picks each family section's class from the composed selector (`policy.name`, `env.simulator`,
`cluster.kind`: tasks.config.registry), merges the result onto it (unknown keys and wrong types are errors there)
and runs `tasks.config.checks.check_config` once. A section with families holds here only the keys every family
has (`PolicyConfig`, `EnvConfig`, `ClusterConfig`); each family's class, in its folder, adds its own. Derived values
(`shard_size`, `batch_size`, `minibatch_size`) are properties computed here and nowhere else.

Frozen: a built config is never changed in place (assigning to a field raises dataclasses.FrozenInstanceError); a
config that differs in some keys is a new one (`tasks.config.edit.replace_key(cfg, "algorithm.lr", 1e-3)`, or a
composition with overrides). Every family class is frozen too (a dataclass cannot mix frozen and not across
inheritance): `@register_family(...)` over `@dataclass(frozen=True)`. A `__post_init__` that must set a field of a
frozen class does it with `object.__setattr__(self, name, value)`, inside that class's own `__post_init__` only
(the one place a frozen object is still being built). No methods but derived values and `EvalConfig.split`. A
section holding a list or dict (`runner.profile_steps`, `policy.hidden_sizes`, ...) cannot be hashed: nothing
relies on a config's hash.
This module imports nothing of dagrl but tasks.config and tasks.algorithms.specs (the estimator specs: plain data
beside the estimators' math; pyproject's import-linter contract).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Optional

from tasks.algorithms.specs import ALGORITHMS, ESTIMATORS, EstimatorSpec
from tasks.config.errors import ConfigError
from tasks.config.registry import default_class

# policy.device / policy.dtype values (tasks.device re-exports them; it computes with them)
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
ACTOR_LOSSES = ("ppo", "filtered_bc")  # algorithm.actor_loss (tasks.update.minibatch_loss)
SEED_LIMIT = 2**31  # seeds are < 2^31: reset seeds add episode offsets and must stay unsigned 32-bit (numpy, SAPIEN)


def estimator_spec(name: str) -> EstimatorSpec:
    """The spec of `algorithm.name` = `name` (tasks.algorithms.specs.ALGORITHMS: the estimators' and SFT's).
    Raises ConfigError (key algorithm.name) listing the known names."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError("algorithm.name", name, f"known: {[*ESTIMATORS, 'sft']} ('sft': behaviour cloning from "
                                                  f"sft.store, no estimator)") from None


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation on separate env instances with fixed seeds and deterministic actions."""

    num_envs: int = 8  # eval envs, split over the env shards like the training envs
    num_episodes: int = 16  # episodes per evaluation (reset seeds seed .. seed + num_episodes - 1)
    seed: int = 1_000_000  # eval episode i uses reset seed `seed + i`, identical at every evaluation
    ignore_terminations: bool = True  # run every eval episode to its time limit: success_at_end is meaningful
    # a validation split: > 0 plays val_episodes more fixed episodes (reset seed `val_seed + i`, disjoint from the
    # eval's) at every eval, and they, not the eval's, choose the run's best checkpoint (`checkpoints/best`), so
    # the eval episodes score a checkpoint they did not pick. 0: the eval's episodes choose it (optimistic)
    val_episodes: int = 0
    val_seed: int = 2_000_000  # validation episode i uses reset seed `val_seed + i`

    def split(self, name: str) -> "EvalConfig":
        """The episodes of split `name` as an EvalConfig: "eval" (this one) or "val" (num_episodes = val_episodes,
        seed = val_seed, no validation split of its own; the same envs per shard and termination rule).

        Raises:
            ValueError: an unknown split, or "val" without a validation split (val_episodes = 0)."""
        if name == "eval":
            return self
        if name != "val" or not self.val_episodes:
            raise ValueError(f"no eval split {name!r} (splits: 'eval', and 'val' with env.eval.val_episodes > 0)")
        return replace(self, num_episodes=self.val_episodes, seed=self.val_seed, val_episodes=0)


@dataclass(frozen=True)
class EnvConfig:
    """Simulator and env task: the keys every env family has. `num_envs` training envs are split into `num_shards`
    env shards. `simulator` selects the family (tasks/envs/<simulator>/configuration.py adds its own keys)."""

    simulator: str = "maniskill"  # selects the env family: maniskill | libero
    env_id: str = "PushCube-v1"  # the env task (ManiSkill: its env id, e.g. PickCube-v1; LIBERO: the suite)
    obs_mode: str = "state"  # state: the flat state vector; rgb: the state vector plus one camera image
    image_size: int = 64  # square camera image (pixels) with obs_mode=rgb, captured once per chunk step
    control_mode: str = "pd_joint_delta_pos"  # the robot controller the actions drive (ManiSkill's control_mode)
    reward_mode: str = "normalized_dense"  # the env task's reward: normalized_dense | dense | sparse
    sim_backend: str = "physx_cpu"  # physx_cpu: CPU simulation; physx_cuda: ManiSkill's GPU simulation
    max_episode_steps: Optional[int] = None  # None: the env task's own limit (50 for PushCube-v1)
    num_envs: int = 16  # training envs over all env shards
    num_shards: int = 2  # env shards: vectorised groups of num_envs / num_shards envs, each resident on one worker
    auto_reset: bool = True  # an env whose episode ended starts the next one in the same rollout; false: it idles
    # until the rollout ends (one episode per env per rollout; tasks.envs.shard)
    ignore_terminations: bool = False  # run training episodes to their time limit through terminal states
    seed: int = 0  # training episode k of global env g uses reset seed seed + g + k * num_envs
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def shard_size(self) -> int:
        return self.num_envs // self.num_shards


@dataclass(frozen=True)
class PolicyConfig:
    """Policy family: the keys every family has. `name` selects the family (tasks/policies/<name>/configuration.py
    adds its own keys; `model` there names its nn.Module). `num_action_chunks` C actions are predicted per call."""

    name: str = "mlp"  # mlp | token_vla (OpenVLA-OFT-style action tokens) |
    # pi0 | pi05 (transformers' pi0 / pi0.5)
    num_action_chunks: int = 1  # C: actions per policy call (an action chunk), executed before the next call
    model_path: Optional[str] = None  # local checkpoint directory (save_pretrained layout) to start from
    # ----- device and precision of rollout replicas and the one-rank actor / SFT update (tasks.device) -----
    device: str = "cpu"  # cpu | cuda (the worker's CUDA device; needs CUDA)
    dtype: str = "float32"  # float32 | bfloat16 (autocast on CUDA; needs policy.device=cuda)
    # the family's nn.Module as "module:Class" (tasks.policies.policy_class imports it)
    model: ClassVar[str] = ""
    # camera images the family reads per observation ("rgb", then "wrist_rgb"; tasks.prompts.CAMERA_KEYS): an env
    # giving more (LIBERO's env.wrist_camera) is refused for it (tasks.envs.libero.checks)
    cameras: ClassVar[int] = 1
    # the family has an offline memory plan that `cluster.gpu_memory_gib` is checked against (pi0, pi05); without
    # one the key is not checked, said in a note (tasks.config.checks.inert.unchecked_notes)
    memory_plan: ClassVar[bool] = False
    # the family's rules that need its components (an env's instruction table, a checkpoint's files): functions of
    # the whole Config raising ConfigError, run by tasks.policies.check_components (run, validate, eval, record)
    component_checks: ClassVar[tuple] = ()
    # the family's keys a checkpoint fixes (its weights' shapes or meaning): a `model_path` whose config.json
    # `policy` holds other values is refused offline, naming the key and both values
    # (pipelines.components.check_model_path); e.g. the mlp's hidden_sizes and activation
    checkpoint_keys: ClassVar[tuple] = ()


@dataclass(frozen=True)
class AlgorithmConfig:
    """PPO with GAE (ManiSkill's PPO baseline defaults for state-based tasks)."""

    name: str = "ppo"  # selects the advantage estimator (ESTIMATORS): ppo (actor-critic, GAE) | grpo (critic-free,
    # group-relative advantages) | rloo (critic-free, leave-one-out group baseline); or sft (behaviour cloning from
    # sft.store, no estimator)
    group_size: int = 1  # grpo, rloo: envs per group sharing a reset state; groups never straddle env shards
    filter_rewards: bool = False  # grpo: mask out of the loss the groups whose mean score is outside the bounds
    rewards_lower_bound: float = 0.0  # filter_rewards: the lowest group mean score kept
    rewards_upper_bound: float = 1.0  # filter_rewards: the highest group mean score kept
    gamma: float = 0.8  # discount factor of the returns
    gae_lambda: float = 0.9  # GAE's lambda
    reward_type: str = "chunk_level"  # chunk_level: one reward per chunk step; action_level: one per action
    logprob_type: str = "chunk_level"  # the granularity of the log-prob ratio: chunk_level | action_level
    reward_scale: float = 1.0  # factor on the env's rewards before the advantages
    clip_ratio_low: float = 0.2  # PPO: the ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]
    clip_ratio_high: float = 0.2  # PPO: upper side of the clip range (above)
    dual_clip: Optional[float] = None  # dual-clip PPO's c (> 1) bounding the loss where advantages < 0; None: off
    value_clip: Optional[float] = None  # clip of the new values around the rollout's (PPO value clipping); None: off
    entropy_coef: float = 0.0  # weight of the entropy bonus in the actor loss
    value_coef: float = 0.5  # weight of the critic loss
    max_grad_norm: float = 0.5  # gradients clipped to this global norm at every optimizer step
    lr: float = 3e-4  # learning rate (Adam)
    # linear learning-rate decay over the updates (ManiSkill / CleanRL ppo.py `anneal_lr`, there over the run's
    # iterations): the update from weight version v uses lr x max(0, 1 - v / lr_anneal_steps), every param group
    # alike; None: constant. A function of the version, so a resumed run continues the same schedule
    lr_anneal_steps: Optional[int] = None
    update_epochs: int = 8  # passes over the training step's samples per update
    num_minibatches: int = 8  # optimizer steps per epoch (minibatch = batch / num_minibatches)
    normalize_advantages: bool = True  # standardise the advantages over the whole batch before the loss
    target_kl: Optional[float] = 0.1  # stop the update's epochs early once approx_kl exceeds it
    critic_lr: Optional[float] = None  # learning rate of a VLA's value head (None: algorithm.lr for everything)
    lr_scale: dict[str, float] = field(default_factory=dict)  # parameter-name prefix -> factor on the learning rate
    # of the parameters under it (the longest matching prefix wins; e.g. {prefix: 0} freezes the flow VLA's vision
    # tower and prefix LM: those parameters get no gradient and no optimizer state). tasks.update.make_optimizer
    critic_warmup_steps: int = 0  # ppo: the first N updates train only the critic (a fresh value head on a
    # pretrained policy would otherwise steer the policy with meaningless advantages)
    # ----- distributed actor update (tasks.distributed; RLinf actor.global_batch_size / micro_batch_size) -----
    global_batch_size: Optional[int] = None  # samples per optimizer step over all ranks; None: batch / num_minibatches
    micro_batch_size: Optional[int] = None  # samples per forward/backward on one rank (gradients accumulated over
    # the rank's share of each optimizer step: a memory lever, the same update); None: global / num_actor_ranks
    num_actor_ranks: int = 1  # actor_update ranks (one torch.distributed process group, FSDP2)
    offload: bool = False  # move the actor (model + optimizer state) to CPU memory after each update and back
    # before the next, and rollout replicas off their device during the update (tasks.offload; with
    # policy.device=cpu nothing moves: refused there, tasks.config.inert_keys)
    # ----- non-finite values reaching the advantages (tasks.update docstring; owner: the update) -----
    nonfinite: str = "error"  # error: a NaN/inf in a rollout field the update reads stops the step with one line
    # naming field, shard, env, chunk step; mask: those samples leave the loss mask, counted as rollout/nonfinite_*
    # ----- the actor's loss (tasks.update.minibatch_loss) -----
    actor_loss: str = "ppo"  # ppo: the clipped surrogate on the rollout's log-probs. filtered_bc: behaviour cloning
    # (the policy's sft_loss) on the rollout's own chunk steps whose advantage is > 0 (the binary filter of CRR,
    # Wang et al. 2020; with GRPO: the episodes above their group's mean score), no log-prob ratio; a critic, if the
    # estimator has one, is trained as with ppo
    # ----- averaged weights for eval and export (tasks.update.ema_step) -----
    ema_decay: float = 0.0  # > 0: the actor keeps an exponential moving average of its weights, updated after every
    # update, RL or SFT (ema <- d * ema + (1 - d) * weights, from the run's initial weights; Polyak averaging, as
    # openpi trains its VLAs). Evals, checkpoints/best, the hf/ export and pipelines.eval use the average; rollouts
    # act with the trained weights (training itself is unchanged). 0: off

    @property
    def spec(self) -> EstimatorSpec:
        """What `name` is (tasks.algorithms.specs.ALGORITHMS: an estimator's spec, or SFT's: no estimator, no
        rollout). Raises ConfigError for an unknown name."""
        return estimator_spec(self.name)


@dataclass(frozen=True)
class RolloutConfig:
    """One rollout per training step: `chunk_steps` policy calls per env (T)."""

    chunk_steps: int = 100  # T: policy calls per env per rollout (one training step)
    chunk_steps_per_node: int = 50  # graph granularity: chunk steps carried by one env_step node
    inference: str = "colocated"  # colocated: policy replica inside env_step nodes; disaggregated: policy_infer nodes
    pipeline_stage_num: int = 1  # disaggregated: each env shard's envs in p stage groups, one policy_infer node per
    # stage per chunk step, so inference for one stage overlaps env stepping of another (RLinf pipeline_stage_num)
    deterministic: bool = False  # act in the policy's deterministic mode (a flow VLA: the ODE from a random initial
    # noise, as its eval does; the MLP: its mean); those log-probs are no sampling density (the flow VLA's are 0),
    # so only with algorithm.actor_loss=filtered_bc


@dataclass(frozen=True)
class RunnerConfig:
    max_steps: int = 1000  # training steps of the run
    max_env_steps: Optional[int] = None  # stop once the training envs took this many env steps; None: no limit
    max_wall_time_s: Optional[float] = None  # stop once the run trained this long (seconds, resumes included)
    val_check_interval: int = 10  # evaluate every N training steps (and after the last)
    val_at_start: bool = False  # also evaluate before the first training step (the starting policy's score)
    save_interval: int = 20  # checkpoint every N training steps (and after the last)
    keep_checkpoints: int = 2  # the newest N checkpoints are kept (and the best one besides)
    # true: after every checkpoint the run drops its ManiSkill (CPU) env and eval shards and re-creates them from
    # the cursors just saved, as a resume does, so a resume from a checkpoint written inside the loop (periodic,
    # best eval) continues the uninterrupted run bit for bit. The CPU simulator keeps solver and contact state
    # across `reset` that no checkpoint holds (docs/guides/resume.md). Costs a close and a build of every env per
    # checkpoint; false (default): a resumed run is a continuation, not a replay
    exact_resume: bool = False
    resume: Optional[str] = None  # a run id or "latest"
    # stop once eval/success_once reaches this value (val/success_once with a validation split:
    # env.eval.val_episodes > 0, whose episodes choose the best)
    stop_on_eval_success: Optional[float] = None
    max_retries: int = 3  # retries of one step after losing a worker
    # a placed worker alive without progress stalls the step (pipelines/runner/watcher.py): paused for memory this long
    pause_timeout_s: float = 60.0
    stall_timeout_s: float = 900.0  # a task executing past max(this, 4x the longest of its kind), or a worker
    # not heard from this long; then the step is retried on the healthy workers, or the run stops with a checkpoint
    max_staleness: int = 0  # asynchronous steps: rollouts in flight ahead of the update (k); the rollout of step
    # n+k runs on weights v(n) while update n runs, and the update corrects with decoupled PPO. 0: synchronous
    progress: bool = True  # show a progress bar (tqdm: training steps; pipelines.record: episodes)
    # an eval films its first N episodes (at most env.eval.num_episodes; mp4 with step, reward, return, success
    # on the frames, <= 10 fps; tasks.video; which evals: eval_video_interval), logged to MLflow under
    # videos/step_<step>; 0: none; GPU simulation: none. Rendering a frame on a CPU is slow:
    # filming is the eval's serial tail
    eval_videos: int = 2
    eval_video_size: int = 256  # the square frames' side in pixels
    # film only the evals whose training step is a multiple of this (the step-0 eval counts), and the eval after
    # the run's last step (runner.max_steps, or whatever ended the run); 1: every eval. The video is the eval's
    # serial tail, so a long run films every few evals
    eval_video_interval: int = 1
    # training steps (numbered as MLflow's: the first is 1) run under distributed.performance_report, written to
    # <run dir>/profile/step_N.html and logged to MLflow under profile/ (pipelines.runner.perf); [] : none
    profile_steps: list[int] = field(default_factory=list)
    # the training step whose update node runs under torch.profiler on its worker: a Chrome trace
    # <run dir>/profile/update_step_N.json (rank 0's with several ranks), logged under profile/; null: none
    profile_update_step: Optional[int] = None


@dataclass(frozen=True)
class SecurityConfig:
    """`cluster.security`: Dask's TLS settings (`distributed.Security`), for the client of an existing scheduler
    (`cluster.kind=address`, `cluster.address=tls://HOST:PORT`) and for the embedded cluster. Files are PEM paths; a key may sit in its
    cert's file (then give the cert only). Empty (the default): no TLS, as distributed's own default.

    * an existing cluster: `tls_ca_file` (the CA that signed the scheduler's certificate) and the client's own
      `tls_client_cert` (+ `tls_client_key`): Dask's TLS is mutual, distributed builds no TLS context without a
      client certificate; the scheduler's and workers' keys are the existing processes' own business;
    * the embedded cluster: `temporary: true` (a self-signed certificate made in memory for this run,
      `distributed.Security.temporary()`, for every role), or the CA plus certificates for client, scheduler and
      workers (`tls_scheduler_cert`, `tls_worker_cert`, their keys).
    `require_encryption`: refuse unencrypted connections (distributed's meaning); true whenever TLS is set up here.
    Checked by the cluster kinds' rules (pipelines/clusters/checks.py: files exist, cert/key pairs, what each kind
    needs); `pipelines.clusters.security` builds the `distributed.Security` from the files of the kind's roles.
    """

    tls_ca_file: Optional[str] = None  # the CA that signed the certificates
    tls_client_cert: Optional[str] = None  # this driver's client certificate
    tls_client_key: Optional[str] = None  # its key (if not in the cert's file)
    tls_scheduler_cert: Optional[str] = None  # the embedded scheduler's certificate
    tls_scheduler_key: Optional[str] = None  # its key
    tls_worker_cert: Optional[str] = None  # the embedded workers' certificate
    tls_worker_key: Optional[str] = None  # its key
    require_encryption: bool = False  # refuse unencrypted connections
    temporary: bool = False  # the embedded cluster only: a per-run self-signed certificate (needs `cryptography`)


@dataclass(frozen=True)
class ClusterConfig:
    """Where the workers come from: the keys every cluster kind has. `kind` selects the kind (local: the embedded
    cluster; address: an existing scheduler), whose class in pipelines/clusters/<kind>.py adds its own keys."""

    kind: str = "local"  # selects the cluster kind: local | address | slurm | pbs | lsf | sge | kubernetes
    threads_per_worker: int = 1  # threads of each Dask worker the kind starts
    memory_limit: str = "3GiB"  # memory limit of each Dask worker the kind starts (Dask's memory_limit)
    security: SecurityConfig = field(default_factory=SecurityConfig)  # Dask TLS (SecurityConfig)
    # RLinf-style placement of components on devices (GPU i = GPU worker i): keys are a component or a
    # comma-separated list of them, values "all", "N", "A-B", "A,B", "A-B,C"; e.g. {actor: "0-3", env: "0-1",
    # rollout: "2-3"} or {"actor,env,rollout": all}. Empty (or a component left out): actor on device 0, rollout
    # with the actor, env shards round-robin over every env (CPU) worker. pipelines/clusters/ parses and plans it.
    # On the command line: actor='"0,1"' (quoted: Hydra reads a bare comma as a sweep) and
    # '+cluster.component_placement={actor\,env\,rollout: all}' (docs/configuration.md, "Overrides"). rollout is where
    # disaggregated policy_infer nodes run (stage j on rollout device j mod n); with colocated inference it must be
    # placed with env (inference runs inside env_step), else refused (the placement checks).
    component_placement: dict[str, str] = field(default_factory=lambda: {"actor": "", "env": "", "rollout": ""})
    num_gpus: Optional[int] = None  # devices; None: the CUDA devices, on CPU-only machines num_gpu_workers logical ones
    # memory of one GPU (GiB, 2^30 bytes; an H100 80 GB card: ~79): a policy family with an offline memory plan (pi0,
    # pi05: weights, grads, optimizer, activations per micro-batch per GPU) is refused when it needs more, with the
    # fix. None: not checked
    gpu_memory_gib: Optional[float] = None
    COMPONENTS: ClassVar[tuple[str, ...]] = ("actor", "env", "rollout")
    WORKERS_HERE: ClassVar[bool] = True  # the kind's workers run on this machine (policy.device=cuda needs CUDA here)

    @property
    def env_workers(self) -> Optional[int]:
        """The env (CPU) workers the offline estimates may count on: a kind that starts them knows their number
        (local: `num_env_workers`); None for an existing cluster's (known once connected)."""
        return None


@dataclass(frozen=True)
class TrackingConfig:
    uri: Optional[str] = None  # None: sqlite:///<run_root>/mlflow.db
    experiment: Optional[str] = None  # None: the config's `experiment`
    # seconds the pre-flight waits for an http(s) `uri` to answer its /health (a server still starting; 0: one try
    # of 3 s); storage.tracking.check_tracking_uri
    wait_s: float = 120.0


@dataclass(frozen=True)
class StorageConfig:
    save_trajectories: bool = True  # write each step's stored trajectory fields to the run's zarr store


@dataclass(frozen=True)
class SFTConfig:
    """Behaviour cloning from a trajectory store (algorithm.name=sft): chunk steps of the selected episodes."""

    store: Optional[str] = None  # a zarr trajectory store (pipelines.record output, or a run's trajectories.zarr)
    only_success: bool = True  # keep episodes with success_once only
    batch_size: int = 64  # chunk-step samples per gradient step
    updates_per_step: int = 25  # gradient steps per training step (one graph)
    num_loaders: int = 2  # data nodes per training step reading the store in parallel
    # > 0: also fit the value head to the discounted chunk-level returns of EVERY recorded episode (successful or
    # not; algorithm.gamma / reward_scale): a critic warm start for PPO from the SFT checkpoint
    value_coef: float = 0.0
    bc_coef: float = 1.0  # weight of the behaviour-cloning loss; 0 with value_coef > 0 and policy.value_detach: a
    # value-only pass that leaves the loaded policy's weights as they are (e.g. a new critic on an SFT checkpoint)


@dataclass(frozen=True)
class RecordConfig:
    """pipelines.record: run a trained teacher policy with rgb observations and store its episodes."""

    teacher: Optional[str] = None  # a run directory (runs/<experiment>/<run_id>), a run id, or scripted:libero
    num_episodes: int = 128  # episodes to record (rounded up to whole rounds of env.num_envs)
    out: Optional[str] = None  # store path; None: <run_root>/demos/<experiment>.zarr
    deterministic: bool = True  # teacher's mean actions (False: sampled)
    # scripted teachers: std (action units) of Gaussian noise added to the 6 motion dims of every action the expert
    # executes (and the store records), drawn per episode from its seed; the expert corrects it at the next step,
    # so the demonstrations cover states off its nominal path (DART, Laskey et al. 2017, which injects noise the
    # same way); the gripper dim is never perturbed. 0: none
    action_noise: float = 0.0


@dataclass(frozen=True)
class Config:
    """The whole config. Checked by `tasks.config.checks.check_config` (once, by `pipelines.compose.load_config`)."""

    experiment: str = "pushcube_ppo"  # the run's name: <run_root>/<experiment>/<run_id>, its MLflow experiment
    seed: int = 1  # the run's seed (policy initialisation, sampling, minibatch order; tasks.seeding)
    run_root: str = "runs"  # where run directories, recorded stores and the default MLflow store are written
    # the sections with families default to their default family's class (tasks.config.registry.DEFAULTS)
    env: EnvConfig = field(default_factory=lambda: default_class("env", EnvConfig)())
    policy: PolicyConfig = field(default_factory=lambda: default_class("policy", PolicyConfig)())
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    cluster: ClusterConfig = field(default_factory=lambda: default_class("cluster", ClusterConfig)())
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    record: RecordConfig = field(default_factory=RecordConfig)

    # ----- derived values: computed here only -----
    @property
    def batch_size(self) -> int:
        """Chunk-step samples per training step: T * num_envs."""
        return self.rollout.chunk_steps * self.env.num_envs

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.algorithm.num_minibatches

    @property
    def num_segments(self) -> int:
        return self.rollout.chunk_steps // self.rollout.chunk_steps_per_node
