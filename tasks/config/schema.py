"""Structured configs: the one vocabulary shared by conf/ (Hydra YAML), pipelines/ and tasks/.

Hydra composes YAML (conf/config.yaml, the groups conf/{env,policy,algorithm,cluster}/ and an experiment
conf/conf/NAME.yaml); `pipelines.config.load_config` merges the result onto `Config` (unknown keys and wrong
types are errors there) and then calls `Config.validate()`, which raises `ConfigError` with one line naming the
key, the value and the fix. Each section validates its own fields (`EnvConfig.check`, `PolicyConfig.check`,
`AlgorithmConfig.check`, `RolloutConfig.check`, `RunnerConfig.check`, `ClusterConfig.check`); `Config.check_across`
holds the checks that need several sections. What needs a registry, the simulator or the devices is checked by
`pipelines.config.check_components` / `pipelines.cluster.check_placement`; keys that do nothing: `inert_keys`.
Derived values (`shard_size`, `batch_size`, `minibatch_size`) are properties computed here and nowhere else.

This module imports nothing else of `tasks` (pyproject's import-linter contract): the pure helpers other modules
need from it live here (`DEVICES`/`DTYPES`/`cuda_available`, re-exported by tasks.device; `BatchPlan`/
`check_batch_sizes`/`batch_plan`, re-exported by tasks.distributed).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Optional


# policy.device / policy.dtype values (tasks.device re-exports them; it computes with them)
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")


def cuda_available() -> bool:
    """torch.cuda.is_available() (tasks.device re-exports it)."""
    import torch
    return torch.cuda.is_available()


class ConfigError(ValueError):
    """A config value that cannot work. The message is one line: key, value, fix."""

    def __init__(self, key: str, value, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={value!r}: {fix}")


def close_matches(name: str, known, *, n: int = 3, cutoff: float = 0.6) -> list[str]:
    """The names of `known` that `name` may have meant, at most `n`: those `name` is a prefix of (in `known`'s
    order) when there are any, else the `difflib` matches of ratio >= `cutoff` within 0.1 of the best one, best
    first. The one "did you mean" of dagrl: unknown config keys and `conf=`/group names (pipelines.config), env ids
    (tasks.envs), runs and metrics (pipelines.compare)."""
    import difflib
    known = [str(k) for k in known]
    prefixed = [k for k in known if name and k.startswith(name) and k != name]
    if prefixed:
        return prefixed[:n]
    scored = sorted(((difflib.SequenceMatcher(None, name, k).ratio(), -i, k) for i, k in enumerate(known)),
                    reverse=True)
    scored = [(r, k) for r, _, k in scored if r >= cutoff]
    return [k for r, k in scored if r >= scored[0][0] - 0.1][:n] if scored else []


def did_you_mean(name: str, known, **kw) -> str:
    """`"did you mean 'a'?"` / `"did you mean 'a' or 'b'?"` for the `close_matches` of `name`, or "" when none."""
    close = close_matches(name, known, **kw)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


@dataclass
class EvalConfig:
    """Evaluation on separate env instances with fixed seeds and deterministic actions."""

    num_envs: int = 8
    num_episodes: int = 16
    seed: int = 1_000_000  # eval episode i uses reset seed `seed + i`, identical at every evaluation
    ignore_terminations: bool = True  # run every eval episode to its time limit: success_at_end is meaningful
    # a validation split: > 0 plays val_episodes more fixed episodes (reset seed `val_seed + i`, disjoint from the
    # eval's) at every eval, and they, not the eval's, choose the run's best checkpoint (`checkpoints/best`), so
    # the eval episodes score a checkpoint they did not pick. 0: the eval's episodes choose it (optimistic)
    val_episodes: int = 0
    val_seed: int = 2_000_000

    def check(self) -> None:
        """This section's own values. Raises ConfigError (env.eval.*)."""
        _positive(self, "env.eval", ["num_envs", "num_episodes"])
        _check_seed("env.eval.seed", self.seed)
        if self.val_episodes < 0:
            raise ConfigError("env.eval.val_episodes", self.val_episodes,
                              "use 0 (no validation split) or the number of validation episodes (e.g. 200)")
        if self.val_episodes:
            _check_seed("env.eval.val_seed", self.val_seed)
            if self.val_seed < self.seed + self.num_episodes and self.seed < self.val_seed + self.val_episodes:
                raise ConfigError("env.eval.val_seed", self.val_seed,
                                  f"its episodes (reset seeds {self.val_seed}..{self.val_seed + self.val_episodes - 1})"
                                  f" overlap the eval's ({self.seed}..{self.seed + self.num_episodes - 1}): use a "
                                  f"val_seed >= {self.seed + self.num_episodes} (e.g. 2000000)")

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


@dataclass
class EnvConfig:
    """Simulator and env task. `num_envs` training envs are split into `num_shards` env shards."""

    simulator: str = "maniskill"
    env_id: str = "PushCube-v1"
    obs_mode: str = "state"  # state: the flat state vector; rgb: the state vector plus one camera image
    image_size: int = 64  # square camera image (pixels) with obs_mode=rgb, captured once per chunk step
    # ManiSkill: the fraction of the robot's visual-mesh faces the cameras render (tasks.envs.maniskill.mesh_lod: on a CPU a
    # capture's cost is the arm's ~136k triangles, not the pixels); collision meshes untouched: the same dynamics
    robot_visual_lod: float = 1.0
    control_mode: str = "pd_joint_delta_pos"
    reward_mode: str = "normalized_dense"
    sim_backend: str = "physx_cpu"
    # ManiSkill CPU envs: set the joint-position controller's drive targets directly and compute the env task's
    # observation, success and reward from the simulator's poses read once per step (tasks.envs.maniskill.fast_step:
    # bit-identical to ManiSkill's step; PushCube-v1 1.85x, PickCube-v1 1.34x faster per env step); what it does not
    # cover stays ManiSkill's. False: always ManiSkill's step
    fast_step: bool = True
    max_episode_steps: Optional[int] = None  # None: the env task's own limit (50 for PushCube-v1)
    num_envs: int = 16
    num_shards: int = 2
    auto_reset: bool = True
    ignore_terminations: bool = False
    seed: int = 0  # training episode k of global env g uses reset seed seed + g + k * num_envs
    eval: EvalConfig = field(default_factory=EvalConfig)
    # ----- LIBERO (simulator=libero, env_id = the suite; tasks/envs/libero/adapter.py) -----
    task_ids: list[int] = field(default_factory=list)  # the suite's tasks to use; empty: all
    num_trials: Optional[int] = None  # the first N init states of each task's split; None: all
    num_steps_wait: int = 10  # no-op steps after each reset (objects settle); not counted, not trained on
    trial_split: str = "disjoint"  # disjoint: each task's last eval_trials init states are eval-only; shared: both
    eval_trials: int = 10  # init states per task reserved for evaluation with trial_split=disjoint
    # a privileged state: the 8-D proprio state + the goal object's position relative to the end-effector and the
    # goal target's relative to the object (m, from the simulator's poses; 14-D), as ManiSkill's state obs hold
    # the object poses. False: the community's 8-D proprio state only (objects seen through the camera alone)
    object_state: bool = False
    # the prompt of each task: benchmark = LIBERO's task.language (what openpi's and OpenVLA's LIBERO evaluations
    # and their published checkpoints use); bddl = the `(:language ...)` line of the task's BDDL file (differs
    # for 29 of the 130 tasks: "pick the akita black bowl ..." for "pick up the black bowl ...")
    instruction_source: str = "benchmark"

    @property
    def shard_size(self) -> int:
        return self.num_envs // self.num_shards

    def check(self) -> None:
        """This section's own values (the simulator's task and modes: tasks.envs.check_env_config). Raises
        ConfigError (env.*)."""
        e = self
        _positive(self, "env", ["num_envs", "num_shards"])
        _check_seed("env.seed", e.seed)
        self.eval.check()
        if e.simulator == "libero" and e.eval.val_episodes:
            raise ConfigError("env.eval.val_episodes", e.eval.val_episodes,
                              "LIBERO has no validation split: a reset seed above env.eval.seed maps to the "
                              "suite's eval init states (tasks.envs.libero.adapter.reset_state_for_seed), so it would replay "
                              "the eval's episodes; use 0 (the eval's episodes choose checkpoints/best)")
        if not (e.max_episode_steps is None or e.max_episode_steps > 0):
            raise ConfigError("env.max_episode_steps", e.max_episode_steps,
                              "must be >= 1 or null (the env task's own limit)")
        if e.obs_mode == "rgb" and not 8 <= e.image_size <= 512:
            raise ConfigError("env.image_size", e.image_size, "use 8..512 pixels (e.g. 64)")
        if not 0 < e.robot_visual_lod <= 1:
            raise ConfigError("env.robot_visual_lod", e.robot_visual_lod,
                              "the fraction of visual-mesh faces kept: use a value in (0, 1] (1.0: the original "
                              "meshes; 0.1 renders ~5x cheaper on a CPU)")


@dataclass
class PolicyConfig:
    """Policy family and its sizes. `num_action_chunks` C actions are predicted per policy call."""

    name: str = "mlp"  # mlp | flow_vla (pi0-style flow matching) | token_vla (OpenVLA-OFT-style action tokens)
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256, 256])  # mlp
    activation: str = "tanh"  # mlp
    init_logstd: float = -0.5  # mlp
    num_action_chunks: int = 1
    model_path: Optional[str] = None  # local checkpoint directory (save_pretrained layout) to start from
    # ----- VLAs (flow_vla, token_vla) -----
    preset: str = "tiny"  # model sizes: tiny (trains on CPU) or a real-size preset (see the policy module)
    sizes: dict[str, int] = field(default_factory=dict)  # per-key overrides of the preset's sizes
    use_state: bool = True  # condition on the env's state vector (pi0's proprio input)
    # SFT from scratch standardises the state per dimension with the mean / std of sft.store's samples (kept in the
    # checkpoint; std floored at 0.01): without it a linear projection of raw values sees the gripper's 0.035 m
    # open/close swing next to ~1 m positions, and a LIBERO clone ignored the state (README "LIBERO")
    normalize_state: bool = False
    # flow_vla, SFT from scratch: standardise the action targets per dimension with the mean / std of sft.store's
    # executed actions (kept in the checkpoint; std floored at 0.01; the policy un-normalises what it outputs), as
    # pi0/openpi and Diffusion Policy normalise actions: without it the flow loss weighs a dimension by its raw
    # scale, and LIBERO's small rotation deltas (std 0.005-0.06 next to 0.4-0.5 for position) were cloned with a
    # bias that turned the gripper away in closed loop (README "LIBERO")
    normalize_actions: bool = False
    max_prompt_len: int = 48  # instruction tokens (byte-level tokenizer), padded/truncated
    value_head: str = "mean_token"  # mean_token | first_token | last_token: pooling of prefix features
    value_detach: bool = False  # the critic's gradient stops at the prefix features (the VLA trunk is not
    # shaped by the value loss); False = RLinf's default
    critic_state: bool = False  # the value head also reads the raw state vector: [pooled prefix ; state]
    # (an asymmetric critic, Pinto et al. 2018; the simulator's state is there in training even if the actor is
    # vision-only)
    num_denoise_steps: int = 4  # flow_vla: K integration steps of the flow ODE/SDE
    noise_method: str = "flow_sde"  # flow_vla: flow_sde | flow_noise (piRL)
    noise_level: float = 0.5  # flow_vla, flow_sde: a in sigma_t = a * sqrt(t / (1 - t))
    noise_std_min: float = 0.08  # flow_vla, flow_noise: bounds of the learned noise std
    noise_std_max: float = 0.16
    action_bins: int = 256  # token_vla: bins per action dimension
    # token_vla: the softmax temperature of the sampled tokens (rollout act, evaluate, entropy); the argmax tokens of
    # a deterministic act (the eval) do not depend on it
    temperature: float = 1.0
    # ----- device and precision of rollout replicas and the one-rank actor / SFT update (tasks.device) -----
    device: str = "cpu"  # cpu | cuda (the worker's CUDA device; needs CUDA)
    dtype: str = "float32"  # float32 | bfloat16 (autocast on CUDA; needs policy.device=cuda)

    def check(self) -> None:
        """This section's own values (the registry's checks: tasks.policies.check_policy_config). Raises
        ConfigError (policy.*)."""
        p = self
        _positive(self, "policy", ["num_action_chunks"])
        if not (len(p.hidden_sizes) > 0 and min(p.hidden_sizes) > 0):
            raise ConfigError("policy.hidden_sizes", p.hidden_sizes, "needs at least one layer, all sizes >= 1")
        if p.model_path is not None:
            import os
            if not os.path.isfile(os.path.join(p.model_path, "config.json")):
                raise ConfigError("policy.model_path", p.model_path,
                                  "not a save_pretrained checkpoint directory (no config.json there); use the "
                                  "`hf` directory an SFT or RL run writes next to its checkpoints, or null")
            if p.name == "mlp":
                raise ConfigError("policy.model_path", p.model_path,
                                  "the mlp policy starts fresh; model_path is for VLAs (flow_vla, token_vla)")
        if p.value_head not in ("mean_token", "first_token", "last_token"):
            raise ConfigError("policy.value_head", p.value_head, "use mean_token, first_token or last_token")
        if p.noise_method not in ("flow_sde", "flow_noise"):
            raise ConfigError("policy.noise_method", p.noise_method, "use flow_sde or flow_noise")
        if not 0 < p.noise_std_min <= p.noise_std_max:
            raise ConfigError("policy.noise_std_min", p.noise_std_min,
                              f"need 0 < noise_std_min <= noise_std_max={p.noise_std_max}")
        if not p.temperature > 0:
            raise ConfigError("policy.temperature", p.temperature, "use > 0 (1.0: the plain softmax)")
        for key, val in (("policy.num_denoise_steps", p.num_denoise_steps), ("policy.max_prompt_len", p.max_prompt_len),
                         ("policy.action_bins", p.action_bins)):
            if val < 1 or (key == "policy.action_bins" and val < 2):
                raise ConfigError(key, val, "must be >= 1 (action_bins >= 2)")
        if p.device not in DEVICES:
            raise ConfigError("policy.device", p.device, f"use one of {list(DEVICES)}")
        if p.dtype not in DTYPES:
            raise ConfigError("policy.dtype", p.dtype, f"use one of {list(DTYPES)}")
        if p.dtype == "bfloat16" and p.device != "cuda":
            raise ConfigError("policy.dtype", p.dtype, "bfloat16 autocast is for CUDA: set policy.device=cuda "
                              "(on a machine with CUDA) or policy.dtype=float32")


@dataclass(frozen=True)
class EstimatorSpec:
    """What an advantage estimator needs from the rollout and the config, and how its advantages are normalised.

    `algorithm.name` selects one (`ESTIMATORS`; `sft` is the one algorithm without an estimator). This is the part
    the offline checks read, so it is declared here (tasks/config.py imports nothing else of tasks); the math is
    registered under the same name in `tasks.algorithms.estimators` (`register_estimator`, which refuses a name
    without a spec here). Callers ask the spec (`AlgorithmConfig.spec`) or the estimator, never the name.
    """

    name: str  # the algorithm.name that selects it
    advantage: str  # the estimator's own name (gae, grpo): what a saved config's former algorithm.adv_type said
    label: str  # for messages: "PPO", "GRPO"
    summary: str  # one clause for messages: what it needs and how it normalises
    critic: bool  # trains a value function: value loss, and reads values / final_values / bootstrap_values
    groups: bool  # envs in groups of algorithm.group_size sharing every reset seed, scored against each other
    whole_episodes: bool  # scores each env's first episode from the rollout's first chunk step (check_whole_episodes)
    normalisation: str  # "batch": over the update's whole batch when algorithm.normalize_advantages; "group": inside
    # the estimator, per group (normalize_advantages is not read)
    keys: tuple[str, ...]  # the algorithm.* keys it reads among those some estimator does not (ESTIMATOR_KEYS)


ESTIMATORS: dict[str, EstimatorSpec] = {s.name: s for s in (
    EstimatorSpec(name="ppo", advantage="gae", label="PPO",
                  summary="PPO trains a critic and normalises GAE advantages over the whole batch",
                  critic=True, groups=False, whole_episodes=False, normalisation="batch",
                  keys=("gamma", "gae_lambda", "value_coef", "value_clip", "critic_lr", "critic_warmup_steps",
                        "normalize_advantages")),
    EstimatorSpec(name="grpo", advantage="grpo", label="GRPO",
                  summary="GRPO is critic-free (no value loss), without GAE, and normalises its advantages within "
                          "each group",
                  critic=False, groups=True, whole_episodes=True, normalisation="group",
                  keys=("group_size", "filter_rewards", "rewards_lower_bound", "rewards_upper_bound")),
    EstimatorSpec(name="rloo", advantage="rloo", label="RLOO",
                  summary="RLOO is critic-free (no value loss), without GAE, and baselines each episode score with "
                          "the mean of the other members of its group",
                  critic=False, groups=True, whole_episodes=True, normalisation="batch",
                  keys=("group_size", "normalize_advantages")),
)}
ESTIMATOR_KEYS: tuple[str, ...] = tuple(sorted({k for s in ESTIMATORS.values() for k in s.keys}))
NORMALISATIONS = ("batch", "group")


# keys the schema no longer has -> the fix, for a user who still sets one (pipelines.config names it); a run's saved
# config that has one is upgraded by `upgrade_saved_config`
REMOVED_KEYS: dict[str, str] = {
    "algorithm.adv_type": "was removed: algorithm.name selects the advantage estimator (ppo: GAE, grpo: group-"
                          "relative; tasks.config.ESTIMATORS), so drop adv_type (for GRPO: algorithm.name=grpo)",
}


def upgrade_saved_config(container: dict) -> dict:
    """A resolved config saved before a key was removed (a run's config.yaml, e.g. `pipelines.record`'s teacher), as
    a plain nested dict, made loadable by today's schema: `algorithm.adv_type` is dropped when it said what
    `algorithm.name` selects (ppo: gae, grpo: grpo; `sft` never read it). Returns a new dict; others pass unchanged.

    Raises:
        ConfigError: key algorithm.adv_type, when it names another estimator than algorithm.name's.
    """
    algo = container.get("algorithm")
    if not isinstance(algo, dict) or "adv_type" not in algo:
        return container
    algo = dict(algo)
    adv, name = algo.pop("adv_type"), algo.get("name", AlgorithmConfig.name)
    spec = ESTIMATORS.get(name)
    if spec is not None and adv != spec.advantage:
        raise ConfigError("algorithm.adv_type", adv, f"the saved config's algorithm.name={name} uses "
                                                     f"{spec.advantage}; {REMOVED_KEYS['algorithm.adv_type']}")
    return {**container, "algorithm": algo}


def estimator_spec(name: str) -> EstimatorSpec:
    """The spec of `algorithm.name` = `name`. Raises ConfigError (key algorithm.name) listing the known names."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ConfigError("algorithm.name", name, f"known: {[*ESTIMATORS, 'sft']} ('sft': behaviour cloning from "
                                                  f"sft.store, no estimator)") from None


ACTOR_LOSSES = ("ppo", "filtered_bc")  # algorithm.actor_loss (tasks.update.minibatch_loss)


@dataclass
class AlgorithmConfig:
    """PPO with GAE (ManiSkill's PPO baseline defaults for state-based tasks)."""

    name: str = "ppo"  # selects the advantage estimator (ESTIMATORS): ppo (actor-critic, GAE) | grpo (critic-free,
    # group-relative advantages) | rloo (critic-free, leave-one-out group baseline); or sft (behaviour cloning from
    # sft.store, no estimator)
    group_size: int = 1  # grpo, rloo: envs per group sharing a reset state; groups never straddle env shards
    filter_rewards: bool = False  # grpo: mask out of the loss the groups whose mean score is outside the bounds
    rewards_lower_bound: float = 0.0
    rewards_upper_bound: float = 1.0
    gamma: float = 0.8
    gae_lambda: float = 0.9
    reward_type: str = "chunk_level"
    logprob_type: str = "chunk_level"
    reward_scale: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip: Optional[float] = None
    value_clip: Optional[float] = None
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    lr: float = 3e-4
    # linear learning-rate decay over the updates (ManiSkill / CleanRL ppo.py `anneal_lr`, there over the run's
    # iterations): the update from weight version v uses lr x max(0, 1 - v / lr_anneal_steps), every param group
    # alike; None: constant. A function of the version, so a resumed run continues the same schedule
    lr_anneal_steps: Optional[int] = None
    update_epochs: int = 8
    num_minibatches: int = 8
    normalize_advantages: bool = True
    target_kl: Optional[float] = 0.1  # stop the update's epochs early once approx_kl exceeds it
    critic_lr: Optional[float] = None  # learning rate of a VLA's value head (None: algorithm.lr for everything)
    lr_scale: dict[str, float] = field(default_factory=dict)  # parameter-name prefix -> factor on the learning rate
    # of the parameters under it (the longest matching prefix wins; e.g. {prefix: 0} freezes the flow VLA's vision
    # tower and prefix LM: those parameters get no gradient and no optimizer state). tasks.update.make_optimizer
    critic_warmup_steps: int = 0  # ppo: the first N updates train only the critic (a fresh value head on a
    # pretrained policy would otherwise steer the policy with meaningless advantages)
    # ----- distributed actor update (tasks.distributed; RLinf actor.global_batch_size / micro_batch_size) -----
    global_batch_size: Optional[int] = None  # samples per optimizer step over all ranks; None: batch / num_minibatches
    micro_batch_size: Optional[int] = None  # samples per forward/backward on one rank; None: global / num_actor_ranks
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
    def spec(self) -> Optional[EstimatorSpec]:
        """The estimator `name` selects (ESTIMATORS); None for sft. Raises ConfigError for an unknown name."""
        return None if self.name == "sft" else estimator_spec(self.name)

    def check(self) -> None:
        """This section's own values (the estimator against env/policy/sft: Config.check_across). Raises
        ConfigError (algorithm.*)."""
        a = self
        _positive(self, "algorithm", ["update_epochs", "num_minibatches"])
        for key, val, ok in [("algorithm.reward_type", a.reward_type, ("chunk_level", "action_level")),
                             ("algorithm.logprob_type", a.logprob_type,
                              ("chunk_level", "action_level", "token_level"))]:
            if val not in ok:
                raise ConfigError(key, val, f"use one of {list(ok)}")
        if a.actor_loss not in ACTOR_LOSSES:
            raise ConfigError("algorithm.actor_loss", a.actor_loss, f"use one of {list(ACTOR_LOSSES)}")
        if a.reward_type == "action_level" and a.logprob_type == "chunk_level":
            raise ConfigError("algorithm.logprob_type", a.logprob_type,
                              "action_level rewards need per-action log-probs: set algorithm.logprob_type="
                              "action_level or token_level (or algorithm.reward_type=chunk_level)")
        if not 0.0 < a.gamma <= 1.0:
            raise ConfigError("algorithm.gamma", a.gamma, "must be in (0, 1]")
        if not 0.0 <= a.gae_lambda <= 1.0:
            raise ConfigError("algorithm.gae_lambda", a.gae_lambda, "must be in [0, 1]")
        if a.clip_ratio_low <= 0 or a.clip_ratio_high <= 0:
            raise ConfigError("algorithm.clip_ratio_low/high", (a.clip_ratio_low, a.clip_ratio_high),
                              "both must be > 0")
        if a.dual_clip is not None and a.dual_clip <= 1.0:
            raise ConfigError("algorithm.dual_clip", a.dual_clip, "must be > 1 (or null to disable)")
        for key, val, ok, fix in [
            ("algorithm.lr", a.lr, a.lr > 0, "must be > 0"),
            ("algorithm.max_grad_norm", a.max_grad_norm, a.max_grad_norm > 0, "must be > 0"),
            ("algorithm.reward_scale", a.reward_scale, a.reward_scale > 0, "must be > 0"),
            ("algorithm.entropy_coef", a.entropy_coef, a.entropy_coef >= 0, "must be >= 0"),
            ("algorithm.value_coef", a.value_coef, a.value_coef >= 0, "must be >= 0"),
            ("algorithm.value_clip", a.value_clip, a.value_clip is None or a.value_clip > 0, "must be > 0 or null"),
            ("algorithm.target_kl", a.target_kl, a.target_kl is None or a.target_kl > 0, "must be > 0 or null"),
            ("algorithm.critic_lr", a.critic_lr, a.critic_lr is None or a.critic_lr > 0, "must be > 0 or null"),
            ("algorithm.lr_anneal_steps", a.lr_anneal_steps, a.lr_anneal_steps is None or a.lr_anneal_steps >= 1,
             "must be >= 1 (updates until the learning rate reaches 0) or null (constant)"),
            ("algorithm.critic_warmup_steps", a.critic_warmup_steps, a.critic_warmup_steps >= 0, "must be >= 0"),
            *((f"algorithm.lr_scale.{k}", v, v >= 0, "must be >= 0 (0 freezes those parameters)")
              for k, v in a.lr_scale.items()),
        ]:
            if not ok:
                raise ConfigError(key, val, fix)
        if a.offload and a.num_actor_ranks > 1:
            raise ConfigError("algorithm.offload", a.offload, "offload is wired for the one-rank update: use "
                              "algorithm.num_actor_ranks=1 or algorithm.offload=false")
        if not 0.0 <= a.ema_decay < 1.0:
            raise ConfigError("algorithm.ema_decay", a.ema_decay, "must be in [0, 1) (0: no averaged weights)")
        if a.ema_decay and a.num_actor_ranks > 1:
            raise ConfigError("algorithm.ema_decay", a.ema_decay, "averaged weights are kept by the one-rank "
                              "update: use algorithm.num_actor_ranks=1 or algorithm.ema_decay=0")
        if a.offload and a.name == "sft":
            raise ConfigError("algorithm.offload", a.offload, "the SFT update does not offload: use "
                              "algorithm.offload=false with algorithm.name=sft")
        self._check_nonfinite()

    def _check_nonfinite(self) -> None:
        """algorithm.nonfinite (read by tasks.update.advantages)."""
        if self.nonfinite not in ("error", "mask"):
            raise ConfigError("algorithm.nonfinite", self.nonfinite,
                              "use 'error' (stop at a NaN/inf, naming where) or 'mask' (drop those samples from the "
                              "loss and count them as rollout/nonfinite_*)")


@dataclass
class RolloutConfig:
    """One rollout per training step: `chunk_steps` policy calls per env (T)."""

    chunk_steps: int = 100
    chunk_steps_per_node: int = 50  # graph granularity: chunk steps carried by one env_step node
    inference: str = "colocated"  # colocated: policy replica inside env_step nodes; disaggregated: policy_infer nodes
    pipeline_stage_num: int = 1  # disaggregated: each env shard's envs in p stage groups, one policy_infer node per
    # stage per chunk step, so inference for one stage overlaps env stepping of another (RLinf pipeline_stage_num)
    deterministic: bool = False  # act in the policy's deterministic mode (a flow VLA: the ODE from a random initial
    # noise, as its eval does; the MLP: its mean); those log-probs are no sampling density (the flow VLA's are 0),
    # so only with algorithm.actor_loss=filtered_bc

    def check(self) -> None:
        """This section's own values. Raises ConfigError (rollout.*)."""
        r = self
        _positive(self, "rollout", ["chunk_steps", "chunk_steps_per_node"])
        if r.inference not in ("colocated", "disaggregated"):
            raise ConfigError("rollout.inference", r.inference, "use 'colocated' or 'disaggregated'")
        p = r.pipeline_stage_num
        if p < 1:
            raise ConfigError("rollout.pipeline_stage_num", p, "must be >= 1")
        if p > 1 and r.inference != "disaggregated":
            raise ConfigError("rollout.pipeline_stage_num", p, "pipelines inference against env stepping across "
                              "nodes: set rollout.inference=disaggregated (colocated nodes run inference inline)")


@dataclass
class RunnerConfig:
    max_steps: int = 1000
    max_env_steps: Optional[int] = None
    max_wall_time_s: Optional[float] = None
    val_check_interval: int = 10  # evaluate every N training steps (and after the last)
    val_at_start: bool = False  # also evaluate before the first training step (the starting policy's score)
    save_interval: int = 20  # checkpoint every N training steps (and after the last)
    keep_checkpoints: int = 2
    # true: after every checkpoint the run drops its ManiSkill (CPU) env and eval shards and re-creates them from
    # the cursors just saved, as a resume does, so a resume from a checkpoint written inside the loop (periodic,
    # best eval) continues the uninterrupted run bit for bit. The CPU simulator keeps solver and contact state
    # across `reset` that no checkpoint holds (README "Resume"). Costs ~0.35 s per env per checkpoint (close +
    # build); false (default): a resumed run is a continuation, not a replay
    exact_resume: bool = False
    resume: Optional[str] = None  # a run id or "latest"
    # stop once eval/success_once reaches this value (val/success_once with a validation split:
    # env.eval.val_episodes > 0, whose episodes choose the best)
    stop_on_eval_success: Optional[float] = None
    max_retries: int = 3  # retries of one step after losing a worker
    # a placed worker alive without progress stalls the step (pipelines/recovery.py): paused for memory this long
    pause_timeout_s: float = 60.0
    stall_timeout_s: float = 900.0  # a task executing past max(this, 4x the longest of its kind), or a worker
    # not heard from this long; then the step is retried on the healthy workers, or the run stops with a checkpoint
    max_staleness: int = 0  # asynchronous steps: rollouts in flight ahead of the update (k); the rollout of step
    # n+k runs on weights v(n) while update n runs, and the update corrects with decoupled PPO. 0: synchronous
    progress: bool = True
    # an eval films its first N episodes (at most env.eval.num_episodes; mp4 with step, reward, return, success
    # on the frames, <= 10 fps; tasks.video; which evals: eval_video_interval), logged to MLflow under
    # videos/step_<step>; 0: none; GPU simulation: none. A frame costs ~0.05-0.3 s on a CPU (lavapipe) with the
    # load: one 26-frame PushCube episode ~1.3 s on the idle 2-core VM (2026-12-05), ~10-15 s for 2 under load
    eval_videos: int = 2
    eval_video_size: int = 256  # the square frames' side in pixels
    # film only the evals whose training step is a multiple of this (the step-0 eval counts), and the eval after
    # the run's last step (runner.max_steps, or whatever ended the run); 1: every eval. The video is the eval's
    # serial tail (the default job: ~1.3 s of its ~2.9 s eval on the idle 2-core VM, 2026-12-05), so a long run
    # films every few evals
    eval_video_interval: int = 1
    # training steps (numbered as MLflow's: the first is 1) run under distributed.performance_report, written to
    # <run dir>/profile/step_N.html and logged to MLflow under profile/ (pipelines.runner.perf); [] : none
    profile_steps: list[int] = field(default_factory=list)
    # the training step whose update node runs under torch.profiler on its worker: a Chrome trace
    # <run dir>/profile/update_step_N.json (rank 0's with several ranks), logged under profile/; null: none
    profile_update_step: Optional[int] = None

    def check(self) -> None:
        """This section's own values. Raises ConfigError (runner.*)."""
        n = self
        _positive(self, "runner", ["max_steps", "val_check_interval", "save_interval"])
        for key, val, ok, fix in [
            ("runner.max_wall_time_s", n.max_wall_time_s, n.max_wall_time_s is None or n.max_wall_time_s > 0,
             "must be > 0 or null"),
            ("runner.max_env_steps", n.max_env_steps, n.max_env_steps is None or n.max_env_steps > 0,
             "must be >= 1 or null"),
            ("runner.keep_checkpoints", n.keep_checkpoints, n.keep_checkpoints >= 1, "must be >= 1"),
            ("runner.max_retries", n.max_retries, n.max_retries >= 0, "must be >= 0"),
            ("runner.pause_timeout_s", n.pause_timeout_s, n.pause_timeout_s > 0,
             "must be > 0 (seconds a placed worker may stay paused for memory)"),
            ("runner.stall_timeout_s", n.stall_timeout_s, n.stall_timeout_s > 0,
             "must be > 0 (seconds a task may execute, at least, before the step counts as stalled)"),
            ("runner.eval_videos", n.eval_videos, n.eval_videos >= 0,
             "must be >= 0 (the eval episodes filmed per evaluation; 0: none)"),
            ("runner.eval_video_size", n.eval_video_size, 64 <= n.eval_video_size <= 1024,
             "must be in [64, 1024] (pixels of the square video frames)"),
            ("runner.eval_video_interval", n.eval_video_interval, n.eval_video_interval >= 1,
             "must be >= 1 (evals at steps that are multiples of it are filmed, and the last step's; 1: every eval)"),
            ("runner.stop_on_eval_success", n.stop_on_eval_success,
             n.stop_on_eval_success is None or 0 < n.stop_on_eval_success <= 1, "must be in (0, 1] or null"),
        ]:
            if not ok:
                raise ConfigError(key, val, fix)
        if n.resume is not None and not n.resume:
            raise ConfigError("runner.resume", n.resume, "use a run id, 'latest', or null")
        if n.max_staleness < 0:
            raise ConfigError("runner.max_staleness", n.max_staleness, "must be >= 0 (0: synchronous steps)")
        bad = [s for s in n.profile_steps if not 1 <= s <= n.max_steps]
        if bad or len(set(n.profile_steps)) != len(n.profile_steps):
            raise ConfigError("runner.profile_steps", list(n.profile_steps),
                              f"use distinct training steps in 1..runner.max_steps={n.max_steps} (the first step is "
                              f"1), e.g. [1,{min(2, n.max_steps)}]; [] profiles none")
        if n.profile_update_step is not None and not 1 <= n.profile_update_step <= n.max_steps:
            raise ConfigError("runner.profile_update_step", n.profile_update_step,
                              f"use a training step in 1..runner.max_steps={n.max_steps} (the first step is 1), "
                              f"or null")


@dataclass
class SecurityConfig:
    """`cluster.security`: Dask's TLS settings (`distributed.Security`), for the client of an existing scheduler
    (`cluster.address=tls://HOST:PORT`) and for the embedded cluster. Files are PEM paths; a key may sit in its
    cert's file (then give the cert only). Empty (the default): no TLS, as distributed's own default.

    * an existing cluster: `tls_ca_file` (the CA that signed the scheduler's certificate) and the client's own
      `tls_client_cert` (+ `tls_client_key`): Dask's TLS is mutual, distributed builds no TLS context without a
      client certificate; the scheduler's and workers' keys are the existing processes' own business;
    * the embedded cluster: `temporary: true` (a self-signed certificate made in memory for this run,
      `distributed.Security.temporary()`, for every role), or the CA plus certificates for client, scheduler and
      workers (`tls_scheduler_cert`, `tls_worker_cert`, their keys).
    `require_encryption`: refuse unencrypted connections (distributed's meaning); true whenever TLS is set up here.
    Checked by `check` (files exist, cert/key pairs, what each cluster needs); `pipelines.cluster.security`
    builds the `distributed.Security`.
    """

    tls_ca_file: Optional[str] = None
    tls_client_cert: Optional[str] = None
    tls_client_key: Optional[str] = None
    tls_scheduler_cert: Optional[str] = None
    tls_scheduler_key: Optional[str] = None
    tls_worker_cert: Optional[str] = None
    tls_worker_key: Optional[str] = None
    require_encryption: bool = False
    temporary: bool = False  # the embedded cluster only: a per-run self-signed certificate (needs `cryptography`)
    FILES: ClassVar[tuple[str, ...]] = ("tls_ca_file", "tls_client_cert", "tls_client_key", "tls_scheduler_cert",
                                        "tls_scheduler_key", "tls_worker_cert", "tls_worker_key")

    def enabled(self) -> bool:
        """TLS is set up: any file given, or `temporary`, or `require_encryption`."""
        return self.temporary or self.require_encryption or any(getattr(self, f) for f in self.FILES)

    def check(self, remote: bool) -> None:
        """The files exist; a key has its cert; what the cluster needs is there. `remote`: `cluster.address` is
        set (else the embedded cluster). Raises ConfigError naming `cluster.security.<key>`."""
        import os
        k = "cluster.security"
        for f in self.FILES:
            path = getattr(self, f)
            if path and not os.path.isfile(os.path.expanduser(path)):
                raise ConfigError(f"{k}.{f}", path, "no such file; give the path of a PEM file (README \"Running on "
                                                    "an existing cluster\", cluster.security)")
        for role in ("client", "scheduler", "worker"):
            if getattr(self, f"tls_{role}_key") and not getattr(self, f"tls_{role}_cert"):
                raise ConfigError(f"{k}.tls_{role}_key", getattr(self, f"tls_{role}_key"),
                                  f"a key without its certificate: give {k}.tls_{role}_cert too")
        if self.temporary and any(getattr(self, f) for f in self.FILES):
            first = next(f for f in self.FILES if getattr(self, f))
            raise ConfigError(f"{k}.temporary", True, f"makes its own certificate; {k}.{first} would be ignored: "
                                                      f"drop one of them")
        if not self.enabled():
            return
        if remote:
            if self.temporary:
                raise ConfigError(f"{k}.temporary", True, "a per-run certificate is for the embedded cluster only "
                                                          "(an existing scheduler cannot know it); give "
                                                          f"{k}.tls_ca_file and tls_client_cert instead")
            if not self.tls_ca_file:
                raise ConfigError(f"{k}.tls_ca_file", None, "TLS to an existing scheduler needs the CA that signed "
                                                            "its certificate: give the CA's PEM file")
            if not self.tls_client_cert:
                raise ConfigError(f"{k}.tls_client_cert", None, "Dask's TLS is mutual: the client needs its own "
                                                                "certificate (signed by a CA the scheduler trusts)")
            return
        if self.temporary:
            return
        missing = [f for f in ("tls_ca_file", "tls_client_cert", "tls_scheduler_cert", "tls_worker_cert")
                   if not getattr(self, f)]
        if missing:
            raise ConfigError(f"{k}.{missing[0]}", None, "TLS on the embedded cluster needs the CA and certificates "
                                                         "for client, scheduler and workers (tls_ca_file, "
                                                         "tls_client_cert, tls_scheduler_cert, tls_worker_cert); "
                                                         f"or set {k}.temporary=true for a per-run self-signed one")


@dataclass
class ClusterConfig:
    address: Optional[str] = None  # tcp://host:8786 (tls://host:8786 with cluster.security) of an existing
    # scheduler; None starts the embedded local cluster
    host: str = "127.0.0.1"  # the interface the embedded cluster's scheduler and workers bind to (0.0.0.0: all)
    num_env_workers: int = 2
    num_gpu_workers: int = 1
    threads_per_worker: int = 1
    # torch intra-op threads of each GPU-resource (actor) worker of the embedded cluster; None: the cores the env
    # workers leave (os.cpu_count() - num_env_workers, at least 1). Idle threads sleep (OMP_WAIT_POLICY=PASSIVE)
    # rather than spin, so more threads than free cores degrade gracefully (README "Where the update's time goes")
    actor_threads: Optional[int] = None
    memory_limit: str = "3GiB"
    dashboard_address: str = "127.0.0.1:8787"  # the embedded scheduler's dashboard (":8787": every interface)
    security: SecurityConfig = field(default_factory=SecurityConfig)  # Dask TLS (SecurityConfig)
    connect_timeout_s: float = 30.0
    start_timeout_s: float = 120.0  # the embedded cluster: every worker up within this, else one-line error
    # RLinf-style placement of components on devices (GPU i = GPU worker i): keys are a component or a
    # comma-separated list of them, values "all", "N", "A-B", "A,B", "A-B,C"; e.g. {actor: "0-3", env: "0-1",
    # rollout: "2-3"} or {"actor,env,rollout": all}. Empty (or a component left out): actor on device 0, rollout
    # with the actor, env shards round-robin over every env (CPU) worker. pipelines/cluster.py parses and plans it.
    # On the command line: actor='"0,1"' (quoted: Hydra reads a bare comma as a sweep) and
    # '+cluster.component_placement={actor\,env\,rollout: all}' (README "Commas, lists, dicts"). rollout is where
    # disaggregated policy_infer nodes run (stage j on rollout device j mod n); with colocated inference it must be
    # placed with env (inference runs inside env_step), else refused (pipelines.cluster.check_placement_effect).
    component_placement: dict[str, str] = field(default_factory=lambda: {"actor": "", "env": "", "rollout": ""})
    num_gpus: Optional[int] = None  # devices; None: the CUDA devices, on CPU-only machines num_gpu_workers logical ones
    COMPONENTS: ClassVar[tuple[str, ...]] = ("actor", "env", "rollout")

    def check(self) -> None:
        """This section's own values (the placement against the devices: pipelines.cluster.check_placement).
        Raises ConfigError (cluster.*)."""
        c = self
        _positive(self, "cluster", ["threads_per_worker"])
        if c.actor_threads is not None and c.actor_threads < 1:
            raise ConfigError("cluster.actor_threads", c.actor_threads,
                              "must be >= 1 (torch threads of the actor worker), or null for the free cores")
        if not c.start_timeout_s > 0:
            raise ConfigError("cluster.start_timeout_s", c.start_timeout_s,
                              "must be > 0 (seconds for the embedded cluster's workers to start)")
        if c.address is not None and not c.address.rsplit(":", 1)[-1].isdigit():
            raise ConfigError("cluster.address", c.address, "use tcp://HOST:PORT (e.g. tcp://host:8786; "
                                                            "tls://HOST:PORT with cluster.security)")
        if c.address is None and not c.host.strip():
            raise ConfigError("cluster.host", c.host, "give the interface to bind to: 127.0.0.1 (this machine "
                                                      "only) or 0.0.0.0 (every interface)")
        c.security.check(remote=c.address is not None)
        if c.address is not None and c.security.enabled() and not c.address.startswith("tls://"):
            raise ConfigError("cluster.address", c.address, "cluster.security sets up TLS: the scheduler's address "
                                                            "is tls://HOST:PORT")
        if c.address is not None and c.address.startswith("tls://") and not c.security.enabled():
            raise ConfigError("cluster.address", c.address, "a tls:// scheduler needs cluster.security (at least "
                                                            "cluster.security.tls_ca_file)")
        if c.address is None and c.num_env_workers < 1:
            raise ConfigError("cluster.num_env_workers", c.num_env_workers, "need at least 1")
        if c.address is None and c.num_gpu_workers < 1:
            raise ConfigError("cluster.num_gpu_workers", c.num_gpu_workers,
                              "need at least 1 (a logical GPU worker on CPU machines)")
        if c.num_gpus is not None and c.num_gpus < 1:
            raise ConfigError("cluster.num_gpus", c.num_gpus, "must be >= 1, or null to detect")
        for names in c.component_placement:
            for name in names.split(","):
                if name.strip() not in c.COMPONENTS:
                    raise ConfigError(f"cluster.component_placement.{names}", c.component_placement[names],
                                      f"unknown component {name.strip()!r}; known: {list(c.COMPONENTS)}")


@dataclass
class TrackingConfig:
    uri: Optional[str] = None  # None: sqlite:///<run_root>/mlflow.db
    experiment: Optional[str] = None  # None: the config's `experiment`


@dataclass
class StorageConfig:
    save_trajectories: bool = True


@dataclass
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


@dataclass
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


@dataclass
class Config:
    experiment: str = "pushcube_ppo"
    seed: int = 1
    run_root: str = "runs"
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
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

    def validate(self) -> "Config":
        """Check every value and combination that cannot work; raise ConfigError (one line) on the first.

        Each section checks its own fields (`EnvConfig.check`, `PolicyConfig.check`, `AlgorithmConfig.check`,
        `RolloutConfig.check`, `RunnerConfig.check`, `ClusterConfig.check`; the top-level keys here), then
        `check_across` checks what needs several sections. `pipelines.config.load_config` is the one caller of the
        commands (run, validate, record); a saved run config is re-checked through `pipelines.config.to_config`.
        """
        if self.experiment in (".", ".."):
            raise ConfigError("experiment", self.experiment, "use a plain name (it becomes a directory)")
        if "/" in self.experiment or not self.experiment:
            raise ConfigError("experiment", self.experiment, "use a non-empty name without '/'")
        _check_seed("seed", self.seed)
        for section in (self.env, self.policy, self.algorithm, self.rollout, self.runner, self.cluster):
            section.check()
        self.check_across()
        return self

    def check_across(self) -> None:
        """The checks that need several sections (batch shapes, the algorithm against env/policy/sft, asynchronous
        steps and stages, CUDA on this machine, whole episodes for group estimators). Raises ConfigError."""
        e, a, r, p = self.env, self.algorithm, self.rollout, self.policy
        rl = a.name != "sft"  # SFT rolls nothing out: the training envs' and the rollout's shapes are unread
        if rl and r.deterministic and a.actor_loss != "filtered_bc":
            raise ConfigError("rollout.deterministic", r.deterministic,
                              f"deterministic actions carry no log-probs, which algorithm.actor_loss={a.actor_loss} "
                              "needs: set algorithm.actor_loss=filtered_bc or rollout.deterministic=false")
        if rl and e.num_envs % e.num_shards:
            raise ConfigError("env.num_envs", e.num_envs,
                              f"must be divisible by env.num_shards={e.num_shards} (each env shard holds the same "
                              f"number of envs); e.g. env.num_envs={e.num_shards * max(1, e.num_envs // e.num_shards)}")
        if rl and r.inference == "colocated" and r.chunk_steps % r.chunk_steps_per_node:  # disaggregated: one
            raise ConfigError("rollout.chunk_steps_per_node", r.chunk_steps_per_node,  # node per chunk step
                              f"must divide rollout.chunk_steps={r.chunk_steps}")
        if rl and self.batch_size % a.num_minibatches:
            raise ConfigError("algorithm.num_minibatches", a.num_minibatches,
                              f"must divide the batch of rollout.chunk_steps*env.num_envs={self.batch_size} samples")
        if a.num_actor_ranks != 1 or a.global_batch_size is not None or a.micro_batch_size is not None:
            batch_plan(self)  # the RLinf divisibility rules, with the numbers
            if a.num_actor_ranks == 1:  # the one-rank update (tasks.update.actor_update) takes num_minibatches
                key = "algorithm.global_batch_size" if a.global_batch_size is not None else "algorithm.micro_batch_size"
                raise ConfigError(key, getattr(a, key.split(".")[1]), "is used by the multi-rank update only "
                                  "(algorithm.num_actor_ranks > 1); with one rank leave it null and set "
                                  "algorithm.num_minibatches")
            if a.name == "sft":
                raise ConfigError("algorithm.num_actor_ranks", a.num_actor_ranks,
                                  "the SFT update runs on one rank: use 1 with algorithm.name=sft")
            # ranks <= the actor's devices (one GPU worker per rank): pipelines.cluster.check_placement / plan_placement
        spec = a.spec  # ConfigError for an unknown algorithm.name, listing the known ones
        if spec is None:  # sft
            if not self.sft.store:
                raise ConfigError("sft.store", self.sft.store, "algorithm.name=sft needs a trajectory store path")
            import os
            if not os.path.isfile(os.path.join(self.sft.store, "zarr.json")):
                raise ConfigError("sft.store", self.sft.store, "no zarr store there; record one with "
                                                               "`python -m pipelines.record` first")
            if self.sft.value_coef < 0:
                raise ConfigError("sft.value_coef", self.sft.value_coef, "use >= 0 (0: no value warm start)")
            if self.sft.bc_coef < 0 or (self.sft.bc_coef == 0 and not self.sft.value_coef > 0):
                raise ConfigError("sft.bc_coef", self.sft.bc_coef, "use > 0, or 0 together with sft.value_coef > 0 "
                                                                   "(a value-only pass)")
            if self.sft.bc_coef == 0 and not self.policy.value_detach:
                raise ConfigError("sft.bc_coef", self.sft.bc_coef, "a value-only pass must leave the trunk as loaded: "
                                                                   "set policy.value_detach=true")
            if self.sft.value_coef > 0 and a.reward_type != "chunk_level":
                raise ConfigError("sft.value_coef", self.sft.value_coef,
                                  "the value warm start fits chunk-level returns: use algorithm.reward_type=chunk_level")
            for key, val in (("sft.batch_size", self.sft.batch_size), ("sft.updates_per_step", self.sft.updates_per_step),
                             ("sft.num_loaders", self.sft.num_loaders)):
                if val < 1:
                    raise ConfigError(key, val, "must be >= 1")
        if spec is not None and spec.groups:
            if a.group_size < 2:
                raise ConfigError("algorithm.group_size", a.group_size,
                                  f"{spec.label} compares envs within a group: use >= 2 (e.g. 8)")
            if e.num_envs % a.group_size or e.shard_size % a.group_size:
                raise ConfigError("algorithm.group_size", a.group_size,
                                  f"must divide env.num_envs={e.num_envs} and the env shard size {e.shard_size} "
                                  f"(num_envs / num_shards): a group never straddles env shards")
            if a.filter_rewards and a.rewards_lower_bound > a.rewards_upper_bound:
                raise ConfigError("algorithm.rewards_lower_bound", a.rewards_lower_bound,
                                  f"must be <= algorithm.rewards_upper_bound={a.rewards_upper_bound}")
        if a.critic_lr is not None and p.name == "mlp":
            raise ConfigError("algorithm.critic_lr", a.critic_lr, "is for VLAs' value heads; the mlp has one lr: null")
        self._check_async()
        self._check_device()
        check_whole_episodes(self)

    def _check_device(self) -> None:
        """policy.device=cuda needs CUDA here (unless the workers are an existing cluster's)."""
        p = self.policy
        if p.device == "cuda" and self.cluster.address is None and not cuda_available():
            raise ConfigError("policy.device", p.device, "no CUDA device on this machine (torch.cuda.is_available() "
                              "is False): use policy.device=cpu")

    def _check_async(self) -> None:
        """runner.max_staleness and rollout.pipeline_stage_num against the update and the env shards."""
        e, r, a, k = self.env, self.rollout, self.algorithm, self.runner.max_staleness
        if k > 0 and a.num_actor_ranks > 1:
            raise ConfigError("runner.max_staleness", k, "asynchronous steps are wired for the one-rank update only: "
                              "use algorithm.num_actor_ranks=1 or runner.max_staleness=0")
        if k > 0 and a.name == "sft":
            raise ConfigError("runner.max_staleness", k, "SFT steps roll nothing out: use 0 with algorithm.name=sft")
        if k > 0 and a.ema_decay:
            raise ConfigError("algorithm.ema_decay", a.ema_decay, "an eval reads the average after its step's update; "
                              "with runner.max_staleness > 0 a later update may have moved it already: use "
                              "runner.max_staleness=0 or algorithm.ema_decay=0")
        p = r.pipeline_stage_num
        if e.shard_size % p:
            raise ConfigError("rollout.pipeline_stage_num", p,
                              f"must divide the env shard size {e.shard_size} (env.num_envs / env.num_shards)")
        spec = a.spec
        if p > 1 and spec is not None and spec.groups and (e.shard_size // p) % a.group_size:
            raise ConfigError("rollout.pipeline_stage_num", p,
                              f"a stage group of {e.shard_size // p} envs must hold whole {spec.label} groups of "
                              f"algorithm.group_size={a.group_size}")


SEED_LIMIT = 2**31  # seeds are < 2^31: reset seeds add episode offsets and must stay unsigned 32-bit (numpy, SAPIEN)


def _check_seed(key: str, value: int) -> None:
    """`value` (a seed at `key`) is in [0, SEED_LIMIT), else ConfigError: the simulators and numpy take reset seeds
    as unsigned 32-bit integers, reset seeds are the seed plus episode offsets (tasks.seeding), and -1 marks an idle
    env in trajectory stores."""
    if not 0 <= value < SEED_LIMIT:
        raise ConfigError(key, value, f"use a seed in 0..{SEED_LIMIT - 1} (reset seeds are this plus episode offsets, "
                                      f"taken as unsigned 32-bit integers)")


def _positive(section, prefix: str, names: list[str]) -> None:
    """Each of `names` (fields of `section`, a config section at dotted `prefix`) is >= 1, else ConfigError."""
    for name in names:
        value = getattr(section, name)
        if value < 1:
            raise ConfigError(f"{prefix}.{name}", value, "must be >= 1")


# ----- keys that take no effect (every key a user sets takes effect, or is refused) -----
COMMANDS = ("run", "record")  # pipelines.run (and validate of a training config), pipelines.record
VLA_POLICIES = ("flow_vla", "token_vla")


def config_value(cfg: Config, key: str):
    """The value at dotted `key` ('a.b.c'; dict entries by their key, e.g. 'cluster.component_placement.actor').

    Raises:
        KeyError: no such key.
    """
    obj = cfg
    for part in key.split("."):
        if isinstance(obj, dict):
            if part not in obj:
                raise KeyError(key)
            obj = obj[part]
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            raise KeyError(key)
    return obj


def inert_keys(cfg: Config, command: str = "run", cuda_count: int = 0) -> list[tuple[str, str]]:
    """The keys that do nothing for this config under `command`, each with why and the fix: (key, reason).

    A key is a dotted key or a section prefix ('sft' covers 'sft.store', ...). Only keys a user SET (given on the
    command line or in the experiment file; pipelines.config.given_keys) are refused for being here; schema
    defaults are not. `cuda_count`: CUDA devices of the machine (the embedded cluster ignores
    `cluster.num_gpu_workers` when there are some). Placement entries (`cluster.component_placement.*`) are
    checked by pipelines.cluster.check_placement_effect, which knows the devices.
    """
    if command not in COMMANDS:
        raise ValueError(f"command {command!r}: use one of {COMMANDS}")
    e, p, a, r, c = cfg.env, cfg.policy, cfg.algorithm, cfg.rollout, cfg.cluster
    out: list[tuple[str, str]] = []

    def off(keys, why: str) -> None:
        out.extend((k, why) for k in keys)

    # ----- per command: what pipelines.record reads (the env of the recording, C, record.*, the cluster) -----
    if command == "record":
        why = ("is not read by pipelines.record (it reads env.*, policy.num_action_chunks, record.*, cluster.*, "
               "runner.progress, runner.pause_timeout_s, runner.stall_timeout_s, experiment, run_root; the "
               "teacher's policy comes from its run): drop it")
        off(["algorithm", "rollout", "sft", "tracking", "storage", "env.eval", "seed"], why)
        off([f"runner.{k}" for k in RunnerConfig.__dataclass_fields__
             if k not in ("progress", "pause_timeout_s", "stall_timeout_s")], why)  # record's waits are watched too
        off([f"policy.{k}" for k in PolicyConfig.__dataclass_fields__ if k != "num_action_chunks"], why)
        off(["env.auto_reset"], "a recording runs one whole episode per env and round (auto_reset is always off): "
                                "drop it")
    else:
        off(["record"], "is read by `python -m pipelines.record` only: drop it, or record with pipelines.record")

    # ----- env -----
    if e.obs_mode != "rgb":
        off(["env.image_size"], f"sizes the camera image of env.obs_mode=rgb; env.obs_mode={e.obs_mode} renders "
                                f"none: drop it or set env.obs_mode=rgb")
    if e.simulator != "maniskill":
        off(["env.robot_visual_lod"], f"decimates a ManiSkill robot's visual meshes; env.simulator={e.simulator} "
                                      f"does not read it: drop it")
    if e.simulator != "libero":
        off(["env.instruction_source"], f"chooses where LIBERO's task instructions come from; "
                                        f"env.simulator={e.simulator} does not read it: drop it")
    if e.simulator != "maniskill" or e.sim_backend != "physx_cpu":
        off(["env.fast_step"], f"chooses how a ManiSkill CPU env (env.sim_backend=physx_cpu) computes its step; "
                               f"env.simulator={e.simulator} with env.sim_backend={e.sim_backend} does not read it: "
                               f"drop it")

    # ----- policy -----
    if command == "run":
        if p.name != "mlp":
            off(["policy.hidden_sizes", "policy.activation", "policy.init_logstd"],
                f"is read by policy.name=mlp only (policy.name={p.name}): drop it")
        if p.name not in VLA_POLICIES or a.name != "sft" or p.model_path or not p.use_state:
            off(["policy.normalize_state"], "sets a VLA's state statistics from sft.store when SFT trains it from "
                                            "scratch (algorithm.name=sft, no policy.model_path, use_state); a loaded "
                                            "checkpoint keeps its own: drop it")
        if p.name != "flow_vla" or a.name != "sft" or p.model_path:
            off(["policy.normalize_actions"], "sets a flow VLA's action statistics from sft.store when SFT trains it "
                                              "from scratch (policy.name=flow_vla, algorithm.name=sft, no "
                                              "policy.model_path); a loaded checkpoint keeps its own: drop it")
        if p.name not in VLA_POLICIES:
            off(["policy.preset", "policy.sizes", "policy.use_state", "policy.max_prompt_len", "policy.value_head",
                 "policy.value_detach", "policy.critic_state"],
                f"is read by the VLAs only (policy.name=flow_vla|token_vla); policy.name={p.name}: drop it")
        if p.name != "flow_vla":
            off(["policy.num_denoise_steps", "policy.noise_method", "policy.noise_level", "policy.noise_std_min",
                 "policy.noise_std_max"], f"is read by policy.name=flow_vla only (policy.name={p.name}): drop it")
        elif p.noise_method == "flow_sde":
            off(["policy.noise_std_min", "policy.noise_std_max"],
                "bounds the learned std of policy.noise_method=flow_noise; flow_sde uses policy.noise_level: drop it "
                "or set policy.noise_method=flow_noise")
        else:
            off(["policy.noise_level"], "is the noise scale of policy.noise_method=flow_sde; flow_noise learns its "
                                        "std (policy.noise_std_min/max): drop it or set policy.noise_method=flow_sde")
        if p.name != "token_vla":
            off(["policy.action_bins", "policy.temperature"],
                f"is read by policy.name=token_vla only (policy.name={p.name}): drop it")
        spec = a.spec
        critic = spec.critic if spec is not None else cfg.sft.value_coef > 0
        if p.name in VLA_POLICIES and not critic:
            off(["policy.value_head", "policy.value_detach", "policy.critic_state"],
                f"shapes the value head, which algorithm.name={a.name} does not train"
                f"{' (critic-free)' if spec is not None else ' (sft.value_coef=0: no value warm start)'}: drop it")

    # ----- algorithm, rollout, runner, storage, sft -----
    if command == "run":
        rl = a.name != "sft"
        if not rl:
            why = ("is not read by algorithm.name=sft (behaviour cloning from sft.store: no rollouts, no PPO/GRPO "
                   "loss; it reads algorithm.lr/max_grad_norm/critic_lr, sft.*, env.eval.* for evaluation): drop it")
            off([f"algorithm.{k}" for k in ("group_size", "filter_rewards", "rewards_lower_bound",
                                            "rewards_upper_bound", "gae_lambda", "reward_type", "logprob_type",
                                            "clip_ratio_low", "clip_ratio_high", "dual_clip", "value_clip",
                                            "entropy_coef", "value_coef", "update_epochs", "num_minibatches",
                                            "normalize_advantages", "target_kl", "critic_warmup_steps",
                                            "lr_anneal_steps", "global_batch_size", "micro_batch_size", "nonfinite")], why)
            off(["rollout", "storage", "runner.max_env_steps", "env.num_envs", "env.auto_reset",
                 "env.ignore_terminations", "env.seed"],
                "is not read by algorithm.name=sft: SFT steps roll nothing out (the samples come from sft.store; "
                "evaluation uses env.eval.*): drop it")
            if not cfg.sft.value_coef > 0:
                off(["algorithm.gamma", "algorithm.reward_scale", "algorithm.critic_lr"],
                    "is read by the SFT value warm start only (sft.value_coef > 0), sft.value_coef=0: drop it")
        else:
            off(["sft"], f"is read by algorithm.name=sft only (algorithm.name={a.name}): drop it")
        if spec is not None:  # the estimator's keys (EstimatorSpec.keys): those of other estimators do nothing
            for k in ESTIMATOR_KEYS:
                if k not in spec.keys:
                    readers = "|".join(s.name for s in ESTIMATORS.values() if k in s.keys)
                    off([f"algorithm.{k}"], f"is read by algorithm.name={readers} only (algorithm.name={a.name}: "
                                            f"{spec.summary}): drop it")
            if "filter_rewards" in spec.keys and not a.filter_rewards:
                off(["algorithm.rewards_lower_bound", "algorithm.rewards_upper_bound"],
                    "bounds the group filter of algorithm.filter_rewards=true, which is off: drop it or set "
                    "algorithm.filter_rewards=true")
        if a.num_actor_ranks > 1 and a.global_batch_size is not None:
            off(["algorithm.num_minibatches"], "with algorithm.num_actor_ranks > 1 and algorithm.global_batch_size "
                                               "set, the optimizer steps come from global_batch_size: drop one")
        if a.offload and p.device == "cpu":
            off(["algorithm.offload"], "moves the actor and the rollout replicas off their CUDA device between the "
                                       "phases; with policy.device=cpu there is nothing to move: drop it (or set "
                                       "policy.device=cuda)")
        if rl and r.inference == "colocated":
            off(["rollout.pipeline_stage_num"], "splits disaggregated inference into stages; with "
                                                "rollout.inference=colocated inference runs inside the env_step nodes: "
                                                "drop it or set rollout.inference=disaggregated")
        if rl and r.inference == "disaggregated":
            off(["rollout.chunk_steps_per_node"], "sets the length of the colocated env_step nodes; with "
                                                  "rollout.inference=disaggregated every chunk step is one env_step "
                                                  "node: drop it or set rollout.inference=colocated")

    if command == "run":
        if e.sim_backend == "physx_cuda":
            off(["runner.eval_videos", "runner.eval_video_size", "runner.eval_video_interval"],
                "films eval episodes by replaying their actions on the CPU simulator; GPU simulation "
                "(env.sim_backend=physx_cuda) keeps no action log and is not replayable there: drop it")
        elif cfg.runner.eval_videos == 0:
            off(["runner.eval_video_size", "runner.eval_video_interval"],
                "sizes or spaces the eval videos, and runner.eval_videos=0 films none: drop it or set "
                "runner.eval_videos")

    # ----- cluster -----
    if c.address:
        off(["cluster.num_env_workers", "cluster.num_gpu_workers", "cluster.threads_per_worker",
             "cluster.memory_limit", "cluster.dashboard_address", "cluster.start_timeout_s", "cluster.host",
             "cluster.security.tls_scheduler_cert", "cluster.security.tls_scheduler_key",
             "cluster.security.tls_worker_cert", "cluster.security.tls_worker_key"],
            f"configures the embedded local cluster; with cluster.address={c.address} the existing cluster's workers "
            f"are used as they were started: drop it (or drop cluster.address)")
    else:
        off(["cluster.connect_timeout_s"], "is the connect timeout of cluster.address, which is not set (the "
                                           "embedded local cluster starts here): drop it")
        if c.num_gpus is not None:
            off(["cluster.num_gpu_workers"], f"cluster.num_gpus={c.num_gpus} sets the GPU workers: drop one")
        elif cuda_count:
            off(["cluster.num_gpu_workers"], f"the embedded cluster starts one GPU worker per CUDA device ({cuda_count}"
                                             f" here); num_gpu_workers counts logical ones on CPU-only machines: use "
                                             f"cluster.num_gpus to use fewer devices")
    return out


def inert_reason(key: str, inert: list[tuple[str, str]]) -> str | None:
    """The reason of the first entry of `inert` (from `inert_keys`) that is `key` or a section above it, else None."""
    for k, why in inert:
        if key == k or key.startswith(k + "."):
            return why
    return None


def check_whole_episodes(cfg: Config) -> None:
    """An estimator with `whole_episodes` (EstimatorSpec; GRPO) scores each env's FIRST episode of a rollout against
    its group, so that episode must start at the rollout's first chunk step in every env (tasks.envs.shard, lifecycle
    modes). Offline check (no env needed).

    Accepted: env.auto_reset=false (DISABLED: every rollout starts new episodes in every env; episodes still open
    at its end are cut and consume their seeds), or auto_reset=true with episodes aligned to rollouts:
    env.ignore_terminations=true (episodes end only at the time limit), env.max_episode_steps = k *
    policy.num_action_chunks, and rollout.chunk_steps a multiple of k (every rollout starts at an episode start).

    Raises:
        ConfigError: key env.auto_reset (such an estimator whose rollouts can start mid-episode), naming the fix.
    """
    e, C, T, spec = cfg.env, cfg.policy.num_action_chunks, cfg.rollout.chunk_steps, cfg.algorithm.spec
    if spec is None or not spec.whole_episodes or not e.auto_reset:
        return
    L = e.max_episode_steps
    if e.ignore_terminations and L is not None and L % C == 0 and T % (L // C) == 0:
        return
    raise ConfigError("env.auto_reset", True,
                      f"{spec.label} scores each env's first episode of a rollout, and with auto_reset=true a rollout "
                      "can start mid-episode: set env.auto_reset=false (every rollout starts new episodes; open ones "
                      "are cut), or align episodes with rollouts: env.ignore_terminations=true, env.max_episode_steps"
                      f"=k*policy.num_action_chunks (C={C}) and rollout.chunk_steps (={T}) a multiple of k")


check_grpo_episodes = check_whole_episodes  # the former name


# ----- batch sizes of the actor update (offline checks; tasks.distributed re-exports them) -----
@dataclass(frozen=True)
class BatchPlan:
    """Resolved batch sizes of one distributed update (all in samples = chunk steps)."""

    batch_size: int  # B: samples per training step
    num_ranks: int  # R
    global_batch_size: int  # G: samples per optimizer step over all ranks
    micro_batch_size: int  # M: samples per forward/backward on one rank

    @property
    def per_rank_batch_size(self) -> int:
        return self.global_batch_size // self.num_ranks

    @property
    def grad_accum(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.per_rank_batch_size // self.micro_batch_size

    @property
    def num_minibatches(self) -> int:
        """Optimizer steps per update epoch."""
        return self.batch_size // self.global_batch_size


def check_batch_sizes(batch_size: int, num_ranks: int, global_batch_size: int, micro_batch_size: int) -> BatchPlan:
    """Check RLinf's divisibility rules and return the plan.

    Rules: all >= 1; `batch_size % global_batch_size == 0` (whole optimizer steps per epoch);
    `global_batch_size % (micro_batch_size * num_ranks) == 0` (each rank runs whole micro-batches).

    Raises:
        ConfigError: naming the key (algorithm.global_batch_size / micro_batch_size / num_actor_ranks), the value and
            the numbers that do not divide.
    """
    for key, val in (("batch_size", batch_size), ("algorithm.num_actor_ranks", num_ranks),
                     ("algorithm.global_batch_size", global_batch_size),
                     ("algorithm.micro_batch_size", micro_batch_size)):
        if int(val) != val or val < 1:
            raise ConfigError(key, val, "must be an integer >= 1")
    if batch_size % global_batch_size:
        step = micro_batch_size * num_ranks
        divisors = [d for d in range(step, batch_size + 1, step) if batch_size % d == 0]
        hint = f"; e.g. {min(divisors, key=lambda d: abs(d - global_batch_size))}" if divisors else ""
        raise ConfigError("algorithm.global_batch_size", global_batch_size,
                          f"must divide the batch of {batch_size} samples (rollout.chunk_steps*env.num_envs): "
                          f"an update epoch is batch/global optimizer steps{hint}")
    if global_batch_size % (micro_batch_size * num_ranks):
        raise ConfigError("algorithm.micro_batch_size", micro_batch_size,
                          f"micro_batch_size*num_actor_ranks = {micro_batch_size}*{num_ranks} = "
                          f"{micro_batch_size * num_ranks} must divide algorithm.global_batch_size="
                          f"{global_batch_size} (each rank runs global/(micro*ranks) micro-batches per step)")
    return BatchPlan(batch_size, num_ranks, global_batch_size, micro_batch_size)


def batch_plan(cfg: Config, batch_size: int | None = None, num_ranks: int | None = None) -> BatchPlan:
    """The plan for `cfg` (defaults: batch_size = cfg.batch_size, num_ranks = algorithm.num_actor_ranks,
    global = batch / algorithm.num_minibatches, micro = global / ranks). Raises ConfigError (check_batch_sizes)."""
    a = cfg.algorithm
    B = cfg.batch_size if batch_size is None else batch_size
    R = a.num_actor_ranks if num_ranks is None else num_ranks
    G = a.global_batch_size if a.global_batch_size is not None else max(B // a.num_minibatches, 1)
    M = a.micro_batch_size if a.micro_batch_size is not None else max(G // max(R, 1), 1)
    return check_batch_sizes(B, R, G, M)
