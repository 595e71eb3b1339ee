"""LeRobot datasets as demonstrations, in and out (the format itself: `storage.lerobot`).

In: `sft.store` may name a LeRobot v3.0 dataset directory (it has meta/info.json). `pipelines.config.load_config`
checks it against the config (`check_dataset`) and converts it once into a demonstration store of the recording
layout (`dataset_store`: `<run_root>/datasets/<name>-<key>.zarr`, key = the dataset's digest and the settings below;
reused while both are unchanged), which the run then reads like any `pipelines.record` store. The conversion, per
episode of L frames, C = `policy.num_action_chunks`, chunk step t = 0 .. ceil(L / C) - 1:

- obs [O] = `observation.state` of frame t*C; rgb = the frame t*C of each camera video (the first K video features
  in info.json's order, K = the env's cameras), decoded and scaled to `env.image_size` (ffmpeg's area filter);
- actions [C, D] = `action` of frames t*C .. t*C+C-1, step_mask True for those that exist (the rest 0, False);
- task_id = the index of the episode's task string in the run's instruction table (`tasks.envs.instructions`),
  compared without case, surrounding blanks or a final full stop;
- rewards = `next.reward` where the dataset has it, else 0; success at a chunk step = `next.success` of its last
  frame where the dataset has it, else True at the episode's last chunk step (published demonstrations are
  successful ones: `sft.only_success` keeps them); terminated at the last chunk step (`next.done` there, else True);
- episodes are packed 16 to a store step (B = min(16, episodes)), one per env, idle envs with episode_id -1.

Out: `export_store` writes a `pipelines.record` store as a LeRobot dataset, one frame per executed action: the
stored chunk's actions one by one, `observation.state` and the camera images of the chunk's start observation on
every frame of the chunk (a recording stores the observation once per chunk of C actions: record with
policy.num_action_chunks=1 for a new observation on every frame), the episode's instruction as its task, rewards,
done and success as next.reward / next.done / next.success. meta/dagrl.json records the env (simulator, env_id,
control_mode, gripper convention) and C (`observation_every`), which the import checks.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from storage.lerobot import (ACTION, DONE, REWARD, STATE, SUCCESS, Dataset, LeRobotFormatError, is_dataset,
                             open_dataset)
from tasks.config import Config, ConfigError

PACK = 16  # episodes per store step of a converted dataset (one per env)
SOURCE_KEYS = ("simulator", "env_id", "control_mode")  # the env a dataset exported by dagrl names (meta/dagrl.json)

__all__ = ["is_dataset", "check_dataset", "dataset_store", "export_store", "task_key"]


def task_key(s: str) -> str:
    """A task string as instructions are matched: lower case, blanks collapsed, no final full stop."""
    return " ".join(str(s).lower().split()).rstrip(".")


def _source(ds: Dataset) -> dict:
    """meta/dagrl.json of a dataset `export_store` wrote, else {}."""
    p = ds.path / "meta" / "dagrl.json"
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except ValueError:
        raise ConfigError("sft.store", str(ds.path), "meta/dagrl.json is not readable JSON") from None


def _rows(frames: dict, e) -> slice:
    """The rows of episode `e` in `frames` (`Dataset.frames`: sorted by the global frame index)."""
    i = int(np.searchsorted(frames["index"], e.start))
    return slice(i, i + e.length)


def _episode_tasks(ds: Dataset, frames: dict) -> list[str]:
    """The task string of each episode: its first frame's task_index in meta/tasks.parquet."""
    out = []
    for e in ds.episodes:
        i = int(frames["task_index"][_rows(frames, e).start]) if e.length else -1
        if i not in ds.tasks:
            raise ConfigError("sft.store", str(ds.path), f"episode {e.index}'s task_index {i} is not in "
                                                         f"meta/tasks.parquet")
        out.append(ds.tasks[i])
    return out


def check_dataset(cfg: Config) -> Dataset:
    """Check the LeRobot dataset `cfg.sft.store` against the config, offline (metadata and the frames' task
    indices; no video decoded): the features observation.state and action (float32, one dimension), their lengths
    against the env's where its adapter knows them offline (LIBERO; ManiSkill's are known once an env is built),
    the cameras against the env's (`env.obs_mode=rgb`: at least `tasks.envs.num_cameras` video features), every
    episode's task string in the run's instruction table, `next.reward` for a value warm start
    (`sft.value_coef` > 0), and for a dataset dagrl exported (meta/dagrl.json) its env and chunk length.

    Returns the opened dataset. Raises ConfigError (key sft.store) naming the dataset field and the fix."""
    from tasks.envs import action_dim, check_gripper_convention, instructions, num_cameras, state_dim
    path = str(cfg.sft.store)
    try:
        ds = open_dataset(path)
    except LeRobotFormatError as exc:
        raise ConfigError("sft.store", path, str(exc).split(": ", 1)[-1]) from None
    for key, want in ((STATE, state_dim(cfg.env)), (ACTION, action_dim(cfg.env))):
        f = ds.features.get(key)
        if f is None:
            raise ConfigError("sft.store", path, f"meta/info.json has no feature {key!r}; dagrl trains on "
                                                 f"{STATE!r} and {ACTION!r}")
        shape = ds.shape(key)
        if f["dtype"] not in ("float32", "float64") or len(shape) != 1:
            raise ConfigError("sft.store", path, f"features[{key!r}] is {f['dtype']} {list(shape)}; dagrl reads a "
                                                 f"float vector per frame")
        if want is not None and shape[0] != want:
            what = "state" if key == STATE else "action"
            raise ConfigError("sft.store", path, f"features[{key!r}].shape is {list(shape)}, this env's {what} is "
                                                 f"{want}-D (env.simulator={cfg.env.simulator}): use a dataset of "
                                                 f"this env, or the env settings it was made with")
    k = num_cameras(cfg.env)
    if len(ds.cameras) < k:
        raise ConfigError("sft.store", path, f"has {len(ds.cameras)} camera video(s) {ds.cameras} in meta/info.json's "
                                             f"features, the config wants {k} (env.obs_mode={cfg.env.obs_mode}"
                                             f"{', env.wrist_camera' if k > 1 else ''}): use a dataset with the "
                                             f"cameras, or env.obs_mode=state")
    if cfg.sft.value_coef > 0 and REWARD not in ds.features:
        raise ConfigError("sft.value_coef", cfg.sft.value_coef, f"the LeRobot dataset {path} has no {REWARD!r} "
                                                                f"feature to fit a critic to: use sft.value_coef=0")
    src = _source(ds)
    for key in SOURCE_KEYS:
        if src.get(key) is not None and src[key] != getattr(cfg.env, key):
            raise ConfigError("sft.store", path, f"was exported from a recording of env.{key}={src[key]} "
                                                 f"(meta/dagrl.json), this config has env.{key}="
                                                 f"{getattr(cfg.env, key)}: set env.{key}={src[key]}")
    if src.get("gripper_convention"):
        check_gripper_convention("sft.store", path, src["gripper_convention"], cfg.env)
    every, C = int(src.get("observation_every", 1)), cfg.policy.num_action_chunks
    if C % every:
        raise ConfigError("sft.store", path, f"holds a new observation every {every} frames (meta/dagrl.json "
                                             f"observation_every: exported from chunks of {every}), "
                                             f"policy.num_action_chunks={C} would start chunks on held ones: use a "
                                             f"multiple of {every}")
    frames = ds.frames(["task_index"])
    table = [task_key(s) for s in instructions(cfg.env)]
    for e, task in zip(ds.episodes, _episode_tasks(ds, frames)):
        if task_key(task) not in table:
            shown = "; ".join(repr(s) for s in instructions(cfg.env)[:3]) + (" ..." if len(table) > 3 else "")
            raise ConfigError("sft.store", path, f"episode {e.index}'s task {task!r} (meta/tasks.parquet) is not an "
                                                 f"instruction of this env ({shown}): use a dataset of this env's "
                                                 f"tasks")
    return ds


def _settings(cfg: Config) -> dict:
    """What a converted store depends on besides the dataset."""
    from tasks.envs import instructions, num_cameras
    return {"C": cfg.policy.num_action_chunks, "image_size": cfg.env.image_size if num_cameras(cfg.env) else None,
            "cameras": num_cameras(cfg.env), "instructions": list(instructions(cfg.env)),
            "simulator": cfg.env.simulator, "env_id": cfg.env.env_id, "control_mode": cfg.env.control_mode}


def converted_path(cfg: Config) -> Path:
    """Where `dataset_store` keeps the converted store of `cfg.sft.store`: `<run_root>/datasets/<dataset dir
    name>-<key>.zarr`, key = 12 hex digits of sha256 over the dataset's digest (`storage.lerobot.dataset_digest`)
    and `_settings`."""
    from storage.lerobot import dataset_digest
    src = Path(cfg.sft.store).resolve()
    key = hashlib.sha256(json.dumps([dataset_digest(src), _settings(cfg)], sort_keys=True).encode()).hexdigest()
    return Path(cfg.run_root).resolve() / "datasets" / f"{src.name}-{key[:12]}.zarr"


def dataset_store(cfg: Config, echo=print) -> Path:
    """The demonstration store of the LeRobot dataset `cfg.sft.store` under cfg's settings: checked
    (`check_dataset`), then converted into `converted_path(cfg)` unless a complete conversion is there already
    (written under `<path>.partial-<pid>` and renamed). Returns its path.

    Raises ConfigError (sft.store) as `check_dataset`, or for a video that cannot be decoded."""
    ds = check_dataset(cfg)  # also before a kept conversion: the checks read keys the path does not depend on
    out = converted_path(cfg)
    if (out / "zarr.json").is_file():
        return out
    import os
    import shutil
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    echo(f"dagrl: converting the LeRobot dataset {cfg.sft.store} ({len(ds.episodes)} episodes) -> {out}")
    try:
        _convert(cfg, ds, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same conversion first
            if not (out / "zarr.json").is_file():
                raise
    except LeRobotFormatError as exc:
        raise ConfigError("sft.store", str(cfg.sft.store), str(exc).split(": ", 1)[-1]) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(cfg: Config, ds: Dataset, out: Path) -> None:
    """Write dataset `ds` as a demonstration store at `out` (module docstring: the mapping)."""
    from storage.trajectories import TrajectoryStore, write_shard
    from tasks.envs import gripper_convention, store_attrs
    from tasks.trajectory import Dims, record_schema
    s = _settings(cfg)
    C, K, H = s["C"], s["cameras"], s["image_size"]
    keys = [STATE, ACTION, "task_index", *(k for k in (REWARD, DONE, SUCCESS) if k in ds.features)]
    fr = ds.frames(keys)
    table = [task_key(t) for t in s["instructions"]]
    tasks = [table.index(task_key(t)) for t in _episode_tasks(ds, fr)]
    O, D = ds.shape(STATE)[0], ds.shape(ACTION)[0]
    E, B = len(ds.episodes), min(PACK, len(ds.episodes))
    T = max(1, max(-(-e.length // C) for e in ds.episodes))
    fields = record_schema(Dims(obs_dim=O, action_dim=D, num_action_chunks=C, num_values=1,
                                image_size=H if K else None, num_cameras=max(K, 1)))
    attrs = {"env_id": cfg.env.env_id, "simulator": cfg.env.simulator, "obs_mode": cfg.env.obs_mode,
             "control_mode": cfg.env.control_mode, "reward_mode": None, "base_seed": None, "auto_reset": False,
             "ignore_terminations": cfg.env.ignore_terminations, "num_action_chunks": C,
             "max_episode_steps": cfg.env.max_episode_steps, "gripper_convention": gripper_convention(cfg.env),
             **store_attrs(cfg.env), "lerobot_dataset": str(Path(cfg.sft.store).resolve()), "lerobot_fps": ds.fps}
    store = TrajectoryStore.create(out, fields=fields, T=T, num_envs=B, shard_size=B, attrs=attrs)
    cams = ds.cameras[:K]
    index = []
    for n in range(-(-E // B)):
        store.reserve(n)
        data = {name: np.zeros((T, B, *f.shape), f.dtype) for name, f in fields.items()}
        for name in ("episode_id", "episode_seed", "trial_id"):
            data[name][:] = -1
        for b, e in enumerate(ds.episodes[n * B:(n + 1) * B]):
            sl = _rows(fr, e)
            state, action = fr[STATE][sl], fr[ACTION][sl]
            images = [ds.video(c, e, H) for c in cams]
            succ = fr[SUCCESS][sl].astype(bool) if SUCCESS in fr else None
            for t in range(-(-e.length // C)):
                f0, m = t * C, min(C, e.length - t * C)
                data["obs"][t, b] = state[f0]
                if K:
                    data["rgb"][t, b] = images[0][f0] if K == 1 else np.stack([im[f0] for im in images])
                data["actions"][t, b, :m] = action[f0:f0 + m]
                data["step_mask"][t, b, :m] = True
                if REWARD in fr:
                    data["rewards"][t, b, :m] = fr[REWARD][sl][f0:f0 + m]
                data["task_id"][t, b], data["episode_id"][t, b] = tasks[n * B + b], e.index
                last = f0 + m == e.length
                data["success"][t, b] = bool(succ[f0 + m - 1]) if succ is not None else last
                data["terminated"][t, b] = last and (bool(fr[DONE][sl][-1]) if DONE in fr else True)
            index.append({"episode_id": e.index, "seed": -1, "task_id": tasks[n * B + b], "trial_id": -1,
                          "success_once": bool(data["success"][:, b].any()), "episode_len": e.length})
        write_shard(str(out), step=n, shard=0, data=data)
        store.mark_complete(n, global_step=n)
    store.update_attrs(episodes=E, successful_episodes=sum(i["success_once"] for i in index), episode_index=index)


# ---- out -----------------------------------------------------------------------------------------------------
def store_episodes(store_path) -> tuple[list[dict], dict]:
    """The episodes of a `pipelines.record` store as `storage.lerobot.write_dataset` takes them (module docstring:
    one frame per executed action), in episode_id order, and meta/dagrl.json's content.

    Raises ValueError (one line) for a store that is not a finished recording (no `episode_index` attribute: a
    training run's store holds episodes cut by rollout boundaries) or whose instruction table cannot be built."""
    from storage.trajectories import TrajectoryStore
    from tasks.envs import instructions
    from tasks.prompts import CAMERA_KEYS
    from tasks.replay import env_config_from_store
    st = TrajectoryStore.open(store_path)
    if "episode_index" not in st.attrs:
        raise ValueError(f"{store_path} is not a finished recording of pipelines.record (no episode_index "
                         f"attribute); export a store that `python -m pipelines.record` wrote")
    table = instructions(env_config_from_store(st.attrs, {}))
    steps = st.complete_steps()
    read = {k: st.read(k, steps) for k in ("obs", "actions", "step_mask", "rewards", "success", "terminated",
                                           "truncated", "episode_id", "task_id") if k in st.fields}
    rgb = st.read("rgb", steps) if "rgb" in st.fields else None
    episodes = []
    for i in range(len(steps)):
        for b in range(st.num_envs):
            mask = read["step_mask"][i, :, b]  # [T, C]
            if not mask.any():
                continue
            ts, cs = np.nonzero(mask)  # executed actions, in time order
            ep = {"state": read["obs"][i, ts, b], "action": read["actions"][i, ts, b, cs],  # [L, O], [L, D]
                  "reward": read["rewards"][i, ts, b, cs], "images": {},
                  "task": table[int(read["task_id"][i, ts[0], b])], "id": int(read["episode_id"][i, ts[0], b])}
            last_of_chunk = np.r_[ts[1:] != ts[:-1], True]  # the chunk's last executed action
            ep["success"] = read["success"][i, ts, b] & last_of_chunk
            ep["done"] = np.zeros(len(ts), bool)
            ep["done"][-1] = bool(read["terminated"][i, ts[-1], b] or read["truncated"][i, ts[-1], b])
            if rgb is not None:
                img = rgb[i, ts, b]  # [L, H, W, 3] or [L, K, H, W, 3]
                cams = [img] if img.ndim == 4 else [img[:, k] for k in range(img.shape[1])]
                ep["images"] = {f"observation.images.{CAMERA_KEYS[k]}": c for k, c in enumerate(cams)}
            episodes.append(ep)
    episodes.sort(key=lambda e: e.pop("id"))
    a = st.attrs
    meta = {"source_store": str(Path(store_path).resolve()), "observation_every": int(st.fields["actions"].shape[0]),
            **{k: a.get(k) for k in (*SOURCE_KEYS, "gripper_convention", "obs_mode", "reward_mode")}}
    return episodes, meta


def export_store(store_path, out, *, fps: float) -> dict:
    """Write the `pipelines.record` store at `store_path` as a LeRobot v3.0 dataset at `out` (`store_episodes`,
    `storage.lerobot.write_dataset`). Returns {"episodes", "frames", "out", "observation_every"}.

    Raises FileExistsError (`out` exists), ValueError (`store_episodes`), DamagedStore (the store's verified read)."""
    from storage.lerobot import write_dataset
    episodes, meta = store_episodes(store_path)
    if not episodes:
        raise ValueError(f"{store_path} has no executed action to export")
    info = write_dataset(out, episodes, fps=fps, robot_type=meta.get("env_id"), extra_meta=meta)
    return {"episodes": info["total_episodes"], "frames": info["total_frames"], "out": str(out),
            "observation_every": meta["observation_every"]}
