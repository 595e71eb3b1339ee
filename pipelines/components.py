"""The offline checks of a config's components (pipelines.config.load_config with components=True): the registries,
the env family's adapter and its component checks, policy.model_path against the env, sft.store's layout and the
data workers' memory. Each raises ConfigError naming the key, the value and the fix."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from tasks.config import Config, ConfigError

from pipelines.saved_config import read_saved_config  # noqa: F401


def check_components(cfg: Config, command: str = "run") -> None:
    """Validation that needs the component registries: policy name, simulator, env task, Vulkan (`command`: as
    `check_command`; a recording prompts no policy, so it may select several LIBERO tasks).

    Raises:
        ConfigError, tasks.envs.errors.SimulatorUnavailable (ManiSkill: no Vulkan driver).
    """
    from tasks.envs import check_components as check_env_components
    from tasks.policies import check_policy_config
    from tasks.algorithms import get_estimator
    sizes = check_policy_config(cfg.policy)
    if sizes and cfg.env.obs_mode == "rgb" and cfg.env.image_size % sizes.get("patch_size", 1):
        raise ConfigError("env.image_size", cfg.env.image_size,
                          f"must be a multiple of the {cfg.policy.preset} preset's patch_size={sizes['patch_size']} "
                          f"(or override policy.sizes.patch_size)")
    if cfg.algorithm.spec.estimator:  # an RL algorithm: its estimator's math is registered (not only its spec)
        try:
            get_estimator(cfg.algorithm.name)
        except ValueError as exc:
            raise ConfigError("algorithm.name", cfg.algorithm.name, f"{exc} (tasks.algorithms.estimators)") from None
    check_env_components(cfg)  # the env family: its adapter's check, then its COMPONENT_CHECKS (Vulkan, memory)
    if cfg.policy.model_path:
        check_model_path(cfg)
    if command != "record":  # a recording reads no policy or algorithm key (the teacher's come from its run)
        from tasks.policies import check_components as check_policy_components
        check_policy_components(cfg)  # the family's component checks (pi0's prompt length), lr_scale's prefixes
    if not cfg.algorithm.spec.rollout:  # SFT: its samples come from sft.store
        check_sft_store(cfg)
    if cfg.env.eval.num_envs % cfg.env.num_shards:
        raise ConfigError("env.eval.num_envs", cfg.env.eval.num_envs,
                          f"must be divisible by env.num_shards={cfg.env.num_shards} (eval envs are sharded the same way)")


def check_model_path(cfg: Config) -> None:
    """policy.model_path's config.json against the config: family, image size, chunk length, the keys the family
    says a checkpoint fixes (`check_checkpoint_keys`: the mlp's hidden sizes and activation), gripper convention,
    the env it was trained on (`check_source_env`: config.json `env`, completed by its run's config.yaml) and the
    state / action lengths the env's adapter knows offline. Raises ConfigError."""
    import json
    import os
    from storage.exports import export_damage
    p, key = cfg.policy, "policy.model_path"
    damage = export_damage(p.model_path)
    if damage:
        raise ConfigError(key, p.model_path, f"is damaged: {damage}; export it again or use another checkpoint "
                                             f"(a run keeps one hf/ per checkpoint: RUN/checkpoints/global_step_N/hf)")
    try:
        meta = json.loads(open(os.path.join(p.model_path, "config.json")).read())
    except (OSError, ValueError) as exc:
        raise ConfigError(key, p.model_path, f"its config.json is unreadable ({type(exc).__name__}: {exc}); export "
                                             f"it again or use another checkpoint") from None
    if "family" not in meta and meta.get("model_type") == p.name:
        return  # a plain transformers directory of this family (pi0, pi05): the model reads its own config.json
    if meta.get("family") != p.name:
        raise ConfigError(key, p.model_path, other_family_fix(meta, p.name))
    want = cfg.env.image_size if cfg.env.obs_mode == "rgb" else None
    if meta.get("image_size") != want:
        raise ConfigError(key, p.model_path, f"was saved for image_size={meta.get('image_size')}, this config gives "
                                             f"{want} (env.obs_mode={cfg.env.obs_mode}, env.image_size)")
    saved_c = meta.get("policy", {}).get("num_action_chunks")
    if saved_c != p.num_action_chunks:
        raise ConfigError(key, p.model_path, f"was saved with policy.num_action_chunks={saved_c}, this config has "
                                             f"{p.num_action_chunks}")
    check_checkpoint_keys(p, meta)
    from tasks.envs import action_dim, check_gripper_convention, env_ids_share_robot, state_dim, state_hint
    check_gripper_convention(key, p.model_path, (meta.get("env") or {}).get("gripper_convention"), cfg.env)
    src = model_source_env(p.model_path, meta)
    if src.get("simulator") == cfg.env.simulator and env_ids_share_robot(cfg.env):
        # e.g. LIBERO's suites share the robot, its state and its actions, and a VLA is instruction-conditioned: a
        # checkpoint of one suite is evaluated or fine-tuned on another (libero_90 -> libero_10), as the papers do
        src.pop("env_id", None)
    check_source_env(key, p.model_path, src, cfg.env, made="trained")
    want_o = state_dim(cfg.env)
    if want_o is not None and meta.get("obs_dim") not in (None, want_o):
        raise ConfigError(key, p.model_path, f"reads a {meta['obs_dim']}-D state, this env gives {want_o}-D "
                                             f"({state_hint(cfg.env, meta['obs_dim'])})")
    want_a = action_dim(cfg.env)
    if want_a is not None and meta.get("action_dim") not in (None, want_a):
        raise ConfigError(key, p.model_path, f"outputs {meta['action_dim']}-D actions, env.simulator="
                                             f"{cfg.env.simulator} takes {want_a}-D ones: use a checkpoint trained "
                                             f"on this simulator")


def check_checkpoint_keys(p, meta: dict) -> None:
    """The keys the policy family says a checkpoint fixes (its config class's `checkpoint_keys`: the mlp's
    hidden_sizes and activation) against the values saved in config.json `policy`; a key the checkpoint does not
    record is not compared.

    Raises:
        ConfigError(policy.model_path): one line naming every differing policy.KEY with the saved and the configured
            value, and the fix (those values on the command line, or a checkpoint made with this config's)."""
    import json
    saved = meta.get("policy") or {}
    diff = [(k, saved[k], getattr(p, k)) for k in type(p).checkpoint_keys
            if k in saved and json.dumps(saved[k]) != json.dumps(_plain(getattr(p, k)))]
    if diff:
        fix = " ".join(f"policy.{k}={_word(s)}" for k, s, _ in diff)
        raise ConfigError("policy.model_path", p.model_path,
                          f"was saved with {', '.join(f'policy.{k}={_word(s)}' for k, s, _ in diff)}, this config has "
                          f"{', '.join(f'policy.{k}={_word(_plain(o))}' for k, _, o in diff)} (weights of another "
                          f"shape or meaning); set {fix}, or use a checkpoint trained with this config's")


def _plain(value):
    """A config value as its config.json holds it (tuples as lists)."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _word(value) -> str:
    """A saved config.json value as a command-line override's value (`[64,64]`, `tanh`)."""
    import json
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def other_family_fix(meta: dict, name: str) -> str:
    """What a checkpoint's config.json `meta` holds when it is not of policy family `name`, and the fix: the policy
    preset files of its family (`policy=pi0_tiny`: a preset of a dagrl export's own preset first), else that no
    policy family reads it."""
    from pipelines.families import family_presets
    from tasks.config import families
    family = meta.get("family") or meta.get("model_type")  # a dagrl export, else a plain transformers directory
    what = (f"holds a {family!r} checkpoint" if meta.get("family") else
            f"holds a transformers model_type={family!r} model" if family else "holds no dagrl or transformers "
                                                                                "checkpoint (no family, no model_type)")
    if family not in families("policy"):
        return f"{what}, which no policy family reads; policy.name={name}: use a {name} checkpoint"
    presets = family_presets("policy", family)
    own = f"{family}_{(meta.get('policy') or {}).get('preset')}"  # the export's preset file, when it has one
    presets = sorted(presets, key=lambda f: f != own)
    fix = " or ".join(f"policy={f}" for f in presets[:3]) if presets else f"policy.name={family}"
    return f"{what}, this config has policy.name={name}: choose its family's policy, {fix} (with this model_path)"


# What a demo store (its attrs) and a policy checkpoint (config.json `env`, its run's config.yaml) record of the env
# they were made on, compared with the configured env before anything starts. Each decides the layout of the data:
# the simulator and env task the state vector and the prompts' task table (LIBERO: a stored task_id indexes its
# suite's tasks), the control mode the action vector (ManiSkill PushCube-v1: pd_joint_delta_pos 8-D,
# pd_ee_delta_pos 4-D). ManiSkill's state and action lengths are known only once an env is built
# (tasks.rollout.env_dims, on a worker), so offline these recorded names are what shows a mismatch; LIBERO's
# lengths are also checked directly (tasks.envs.state_dim, tasks.envs.action_dim). A name not recorded (stores and exports written
# before it was) is not compared.
SOURCE_ENV_KEYS = ("simulator", "env_id", "control_mode")
SOURCE_ENV_WHY = {"simulator": "another simulator's observations and actions",
                  "env_id": "another env task's observations and instructions",
                  "control_mode": "another controller's actions, of another meaning and length"}


def check_source_env(key: str, value, recorded: dict, env, *, made: str) -> None:
    """Refuse a store or checkpoint (`key`=`value`) whose `recorded` env (SOURCE_ENV_KEYS -> value; absent or None:
    not recorded) differs from `env` (EnvConfig). `made`: "recorded" (a store) or "trained" (a checkpoint).

    Raises:
        ConfigError(key, value): one line naming each differing env.KEY with the recorded and the configured value,
            and the fix: make the data with this env, or set env.KEY to the recorded value.
    """
    diff = [(k, recorded[k], getattr(env, k)) for k in SOURCE_ENV_KEYS
            if recorded.get(k) is not None and recorded[k] != getattr(env, k)]
    if not diff:
        return
    have = ", ".join(f"env.{k}={r}" for k, r, _ in diff)
    want = ", ".join(f"env.{k}={w}" for k, _, w in diff)
    why = "; ".join(SOURCE_ENV_WHY[k] for k, _, _ in diff)
    redo = "record the demos" if made == "recorded" else "train a checkpoint"
    if any(k == "simulator" for k, _, _ in diff):  # not one key to set: a whole env group of that simulator
        fix = f"{redo} with this env, or choose an env group of {diff[0][1]} (env=NAME)"
    else:
        fix = (f"{redo} with {' and '.join(f'env.{k}={w}' for k, _, w in diff)}, or set "
               f"{' '.join(f'env.{k}={r}' for k, r, _ in diff)} to match it")
    raise ConfigError(key, value, f"was {made} with {have}, this config has {want} ({why}); {fix}")


def model_source_env(model_path, meta: dict) -> dict:
    """What a checkpoint records of the env it was trained on: config.json `env` (hf/ exports: simulator, env_id,
    gripper_convention: pipelines.graphs.export_env_meta), completed by the `env` section of its run's saved
    config.yaml when `model_path` is a run's checkpoint (`RUN/checkpoints/global_step_N/hf`, `.../best/hf`), which
    also names the control mode. {} when neither says anything; an unreadable config.yaml adds nothing."""
    from pathlib import Path
    out = {k: v for k, v in (meta.get("env") or {}).items() if v is not None}
    try:
        hf = Path(model_path).resolve()
        ckpt = hf.parent if hf.name == "hf" else hf
        saved = ckpt.parent.parent / "config.yaml"
        if ckpt.parent.name == "checkpoints" and saved.is_file():
            run_env = OmegaConf.to_container(read_saved_config(saved)).get("env") or {}
            out = {**{k: run_env[k] for k in SOURCE_ENV_KEYS if run_env.get(k) is not None}, **out}
    except Exception:  # noqa: BLE001 - not a run's checkpoint after all (or a damaged config.yaml): config.json only
        pass
    return out


def check_sft_store(cfg: Config) -> None:
    """sft.store against the config: gripper convention, the env it was recorded on (`check_source_env`: simulator,
    env task, control mode), state length, chunk length, images, and at least one selectable chunk step.

    Raises ConfigError (sft.store) for each mismatch, and for a store that cannot be read (damaged metadata or
    chunk files: a half-copied or corrupted store; every chunk file of every field the run reads, `sft_fields`, is
    checked to exist) naming the error and the fix."""
    from storage.trajectories import DamagedStore
    try:
        _check_sft_store(cfg)
    except ConfigError:
        raise
    except DamagedStore as exc:  # e.g. its group metadata unreadable: the message names the damage and the fix
        raise ConfigError("sft.store", cfg.sft.store, str(exc).split(": ", 1)[-1]) from None
    except Exception as exc:  # noqa: BLE001 - zarr/numcodecs/json errors of a damaged store: one line naming it
        raise ConfigError("sft.store", cfg.sft.store, f"cannot be read ({type(exc).__name__}: "
                                                      f"{' '.join(str(exc).split())[:200]}): the store is damaged "
                                                      f"or incompletely copied; record it again or copy it whole") \
            from None
    check_sft_memory(cfg)  # a store that passed the checks above reads


def _check_sft_store(cfg: Config) -> None:
    from storage.rundir import store_owner
    from storage.trajectories import TrajectoryStore
    from tasks.demo_index import DamagedStore, sft_fields, sft_index
    from tasks.envs import check_gripper_convention, state_dim, state_hint, store_warnings
    busy = store_owner(cfg.sft.store, readers=False)  # a recording writes it (record.out or its .partial)
    if busy is not None:
        raise ConfigError("sft.store", cfg.sft.store, busy)
    from pipelines.upgrade.store import store_refusal
    old = store_refusal(cfg.sft.store)  # a store of an older format: the upgrade command
    if old is not None:
        raise ConfigError("sft.store", cfg.sft.store, old)
    st = TrajectoryStore.open(cfg.sft.store)
    if "teacher_run" in st.attrs and "episode_index" not in st.attrs:  # pipelines.record writes it last
        raise ConfigError("sft.store", cfg.sft.store, "is a recording that did not finish (pipelines.record was "
                                                      "interrupted or failed before writing its episode index); "
                                                      "record again to a new record.out")
    check_gripper_convention("sft.store", cfg.sft.store, st.attrs["gripper_convention"], cfg.env)
    check_source_env("sft.store", cfg.sft.store, {k: st.attrs.get(k) for k in SOURCE_ENV_KEYS}, cfg.env,
                     made="recorded")
    stored_reward = st.attrs.get("reward_mode")
    if cfg.sft.value_coef > 0 and stored_reward is not None and stored_reward != cfg.env.reward_mode:
        raise ConfigError("sft.store", cfg.sft.store,
                          f"stores rewards of env.reward_mode={stored_reward}, this config has env.reward_mode="
                          f"{cfg.env.reward_mode}: sft.value_coef={cfg.sft.value_coef} would fit the critic an RL run "
                          f"starts from to the other reward's scale; record with env.reward_mode="
                          f"{cfg.env.reward_mode}, set env.reward_mode={stored_reward}, or sft.value_coef=0")
    want_o, obs = state_dim(cfg.env), st.fields.get("obs")
    if want_o is not None and obs is not None and obs.shape[0] != want_o:
        raise ConfigError("sft.store", cfg.sft.store, f"stores a {obs.shape[0]}-D state, this env gives {want_o}-D "
                                                      f"({state_hint(cfg.env, obs.shape[0])})")
    C = cfg.policy.num_action_chunks
    act = st.fields.get("actions")
    if act is None or act.shape[0] != C:
        raise ConfigError("sft.store", cfg.sft.store, f"stores action chunks of {None if act is None else act.shape[0]}, "
                                                      f"policy.num_action_chunks={C}; record with the same C")
    if cfg.env.obs_mode == "rgb":
        rgb = st.fields.get("rgb")
        from tasks.envs import num_cameras
        k, size = num_cameras(cfg.env), cfg.env.image_size
        if rgb is None or tuple(rgb.shape) != ((k, size, size, 3) if k > 1 else (size, size, 3)):
            have = "no images" if rgb is None else \
                f"{rgb.shape[-2]} px images of {rgb.shape[0] if len(rgb.shape) == 4 else 1} camera(s)"
            raise ConfigError("sft.store", cfg.sft.store,
                              f"has {have}, the config wants env.image_size={size} with {k} camera(s) "
                              f"(env.wrist_camera): record with the same settings")
        for w in store_warnings(cfg.env, st.attrs):  # ManiSkill: the arm's visual LOD of the stored images
            import warnings
            warnings.warn(f"sft.store={cfg.sft.store}: {w}", stacklevel=2)
    try:
        sft_index(cfg.sft.store, cfg.sft.only_success)
        # every chunk file the run's data workers will read, stat only (they read through the same check)
        st.check_files(sft_fields(st.fields, cfg.sft.only_success, cfg.sft.value_coef > 0))
    except DamagedStore as exc:  # its message names the damage and the fix
        raise ConfigError("sft.store", cfg.sft.store, str(exc).split(": ", 1)[-1]) from None
    except ValueError as exc:
        raise ConfigError("sft.store", cfg.sft.store, f"{str(exc).split(': ', 1)[-1]}; record more episodes or set "
                                                      f"sft.only_success=false") from None


def check_sft_memory(cfg: Config) -> None:
    """The samples an SFT data worker caches (`tasks.demos._dataset`: with `sft.value_coef` > 0 every executed
    chunk step, else the selected ones) against `cluster.memory_limit`: their estimate
    (`tasks.demo_index.sft_dataset_bytes`) plus the worker's own memory (`SFT_WORKER_BASE_GIB`, measured; a LIBERO
    worker's eval envs by `tasks.envs.env_worker_memory_gib`) must stay under Dask's pause / restart fraction of
    the limit. Without the check a too-large store (e.g. a long RL run's trajectories) had the data workers
    restarted on every retry of step 1. Raises ConfigError (sft.store) with the limit that fits."""
    import math

    from tasks.demo_index import SFT_WORKER_BASE_GIB, sft_dataset_bytes, sft_index
    from tasks.envs import env_worker_memory_gib
    from tasks.resident import memory_bound, memory_limit_bytes
    limit = memory_limit_bytes(cfg.cluster.memory_limit)
    if not limit or cfg.cluster.env_workers is None:  # an existing cluster's workers: known once connected
        return
    value = cfg.sft.value_coef > 0
    rows = len(sft_index(cfg.sft.store, cfg.sft.only_success and not value))
    data_gib = sft_dataset_bytes(cfg.sft.store, rows) / 2 ** 30
    base_gib = SFT_WORKER_BASE_GIB
    per_worker = -(-cfg.env.num_shards // max(cfg.cluster.env_workers, 1))
    env_gib = env_worker_memory_gib(cfg.env, per_worker * (cfg.env.eval.num_envs // cfg.env.num_shards))
    if env_gib is not None:  # a simulator whose envs' memory is measured (LIBERO): the worker holds its eval envs
        base_gib = env_gib
    frac, what = memory_bound()
    need = base_gib + data_gib
    if need > frac * limit / 2 ** 30:
        raise ConfigError("sft.store", cfg.sft.store,
                          f"its {rows} chunk steps{' (every executed one: sft.value_coef > 0)' if value else ''} take "
                          f"~{data_gib:.1f} GiB in each SFT data worker, ~{need:.1f} GiB with the worker's own "
                          f"{base_gib:.1f} GiB: more than {frac:.0%} of "
                          f"cluster.memory_limit={cfg.cluster.memory_limit} (Dask's memory {what} fraction); "
                          f"set cluster.memory_limit={math.ceil(need / frac)}GiB, or train on a smaller store")
