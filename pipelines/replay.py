"""`python -m pipelines.replay RUN_OR_STORE [--episode ID ...] [--num-episodes N] [--video PATH.mp4] [--json]`

Re-simulates episodes of a trajectory store from their reset seed and stored actions, and checks that the
simulator reproduces what the store recorded.

RUN_OR_STORE is a `trajectories.zarr` directory, a run directory holding one, or a run id looked up under
`--run-root` (default `runs`) as `<run-root>/*/<run id>`.

What is compared, per episode (one fresh simulator instance, `tasks.envs.make_single_env`, built from the store's
attributes: env_id, obs_mode, control_mode, reward_mode, max_episode_steps; sim_backend and ignore_terminations
come from the run's config.yaml next to the store when there is one):

* reset: `reset(seed)` with the stored `episode_seed`; its observation against the stored `obs` of the episode's
  first chunk step.
* every chunk step: the stored actions [C, D] are clipped to [-1, 1] (as `EnvShard.chunk_step` does before the
  simulator sees them) and applied in order where the stored `step_mask` is True, stopping where the replayed
  episode ends; the per-action rewards against the stored `rewards` [C] (0 where not executed), and the observation
  after the chunk against the stored `obs` of the episode's next chunk step. After the episode's last chunk step
  there is no stored observation to compare (the final observation is not stored).
* flags: the replayed executed-action mask, terminated, truncated and success of every chunk step against the stored
  `step_mask`, `terminated`, `truncated`, `success`.

Units: `max |Δobs|` is the largest absolute element-wise difference of the observation vectors, in the
observation's own units (rad, rad/s, m, quaternion components for the state obs of ManiSkill tasks);
`max |Δreward|` the largest absolute difference of per-action rewards, in the reward mode's units
(`normalized_dense` is in [0, 1]). Both are computed in float64 from float32 values. An episode is VERIFIED when
both are <= TOLERANCE (1e-5) and all flags agree. ManiSkill's CPU simulation replays bit-identically from
seed + actions (MACHINE.md), so both are expected to be exactly 0.

Which steps belong to an episode: the store's `episode_id` per chunk step and env (episode k of global env g has
id g + k * num_envs); only complete epochs (`TrajectoryStore.complete_steps()`) are read. An episode is complete
when its last stored chunk step has `terminated` or `truncated`, else partial (cut by the end of the store, or by a
missing epoch, after which it cannot be replayed). Its start must be in the store: the first stored chunk step is
the reset when it is the run's first chunk step, when the env's previous chunk step ended another episode, or when
the seed's reset observation equals the stored observation there. An episode restarted from its reset at an epoch
start (a resumed run, a retried rollout task, or `env.auto_reset=false`) is replayed from the last restart.
Episodes whose start predates the store's first complete epoch are skipped with a note.

Default selection: the first `--num-episodes` (3) complete episodes, in order of their first stored step.

`--video PATH.mp4` renders the replayed episodes one after another (the reset frame, then one frame per executed
action, at the task's control frequency) from a second simulator instance created with `render_mode="rgb_array"`.
Rendering on software Vulkan is slow: the first camera env in a process takes 15-30 s, then ~0.1-0.2 s a frame.

Exit codes: 0 every replayed episode verified, 1 otherwise, 2 bad input (one line `error: ...` on stderr).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tasks import trajectory

TOLERANCE = 1e-5
DEFAULT_NUM_EPISODES = 3
STORE_DIR = "trajectories.zarr"
CONFIG_FILE = "config.yaml"

_INDEX_FIELDS = ("episode_id", "episode_seed", "step_mask", "terminated", "truncated", "success")
_REQUIRED_FIELDS = trajectory.REPLAY_FIELDS  # the `replay` fields of tasks.trajectory (the index's among them)


class ReplayInputError(Exception):
    """Bad input to the replay command; the message is one line naming the path or id and the fix."""


# ----------------------------------------------------------------------------------------------------------------
# input resolution
# ----------------------------------------------------------------------------------------------------------------
def resolve_store(arg: str, run_root: str | os.PathLike = "runs") -> Path:
    """The trajectories.zarr path for a store path, a run directory or a run id (under `run_root`)."""
    from storage.rundir import find_run_dir

    p = Path(arg)
    if p.exists():
        if (p / "zarr.json").is_file():
            return p
        if p.is_dir() and (p / STORE_DIR).exists():
            return p / STORE_DIR
        if p.is_dir() and (p / CONFIG_FILE).is_file():
            raise ReplayInputError(f"run directory {p} has no {STORE_DIR} (was storage.save_trajectories false?); "
                                   "replay needs a run that saved trajectories")
        raise ReplayInputError(f"{p} is neither a dagrl trajectory store (a {STORE_DIR} directory) nor a run "
                               f"directory holding one; pass <run_root>/<experiment>/<run_id> or its {STORE_DIR}")
    if os.sep in arg or "/" in arg or arg.endswith(".zarr") or arg in (".", ".."):
        raise ReplayInputError(f"{arg} does not exist; pass an existing {STORE_DIR}, run directory, or a run id "
                               f"(looked up under --run-root)")
    try:
        run_dir = find_run_dir(run_root, arg)
    except (FileNotFoundError, ValueError) as exc:
        raise ReplayInputError(f"{exc}; pass the run directory or its {STORE_DIR}, or set --run-root") from None
    if not (run_dir / STORE_DIR).exists():
        raise ReplayInputError(f"run {arg} ({run_dir}) has no {STORE_DIR} (was storage.save_trajectories false?)")
    return run_dir / STORE_DIR


def open_store(path: Path):
    from storage.trajectories import TrajectoryStore

    try:
        store = TrajectoryStore.open(path)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise ReplayInputError(f"{exc}") from None
    missing = [f for f in _REQUIRED_FIELDS if f not in store.fields]
    if missing:
        raise ReplayInputError(f"trajectory store {path} lacks fields {missing} needed for replay; it was not "
                               "written by pipelines.run (see tasks.trajectory, README \"Trajectory fields\")")
    attrs = store.attrs
    need = [k for k in ("env_id", "obs_mode", "control_mode", "reward_mode") if k not in attrs]
    if need:
        raise ReplayInputError(f"trajectory store {path} lacks attributes {need} needed to rebuild the env; "
                               "it was not written by pipelines.run")
    return store


def run_env_settings(store_path: Path) -> tuple[dict, str | None]:
    """`env` section of the run's config.yaml next to the store ({} when absent) and a note when absent."""
    cfg_path = Path(store_path).parent / CONFIG_FILE
    if not cfg_path.is_file():
        return {}, (f"no {CONFIG_FILE} next to the store: assumed sim_backend=physx_cpu, "
                    "ignore_terminations=false")
    import yaml

    try:
        env = (yaml.safe_load(cfg_path.read_text()) or {}).get("env") or {}
    except yaml.YAMLError:
        return {}, f"{cfg_path} is not valid YAML: assumed sim_backend=physx_cpu, ignore_terminations=false"
    return env, None


def env_config_from_store(attrs: dict, run_env: dict):
    """EnvConfig that rebuilds the store's env: ids and modes from the store attrs, backend from the run config."""
    from tasks.config import EnvConfig

    return EnvConfig(simulator=attrs.get("simulator", "maniskill"), env_id=attrs["env_id"],
                     obs_mode=attrs["obs_mode"], control_mode=attrs["control_mode"],
                     reward_mode=attrs["reward_mode"], sim_backend=run_env.get("sim_backend", "physx_cpu"),
                     max_episode_steps=attrs.get("max_episode_steps"),
                     ignore_terminations=bool(run_env.get("ignore_terminations", False)),
                     auto_reset=bool(run_env.get("auto_reset", True)))


# ----------------------------------------------------------------------------------------------------------------
# which chunk steps belong to which episode
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class StoreIndex:
    """Per-step bookkeeping of the complete epochs, flattened per env to positions p = i * T + t.

    `epochs[i]` is the i-th complete epoch; arrays are [P, B] (`step_mask` [P, B, C]) with P = len(epochs) * T.
    `contiguous[p]` is True when position p directly follows p - 1 in the run (no missing epoch in between).
    """

    epochs: np.ndarray
    T: int
    num_envs: int
    episode_id: np.ndarray
    episode_seed: np.ndarray
    step_mask: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    success: np.ndarray
    contiguous: np.ndarray

    def epoch_t(self, p: int) -> tuple[int, int]:
        return int(self.epochs[p // self.T]), p % self.T


@dataclass
class Episode:
    """One episode id's chunk steps in the store (positions of executed chunk steps, in run order)."""

    id: int
    env: int
    seed: int
    positions: list[int]
    known_start: bool  # the first position is certainly the episode's reset
    complete: bool
    notes: list[str] = field(default_factory=list)


def load_index(store) -> StoreIndex:
    epochs = store.complete_steps()
    T, B = store.T, store.num_envs
    data = {f: store.read(f, epochs) for f in _INDEX_FIELDS}
    P = len(epochs) * T
    flat = {f: v.reshape(P, B, *v.shape[3:]) for f, v in data.items()}
    contiguous = np.ones(P, bool)
    if P:
        contiguous[0] = False
        for i in range(1, len(epochs)):
            contiguous[i * T] = bool(epochs[i] == epochs[i - 1] + 1)
    return StoreIndex(epochs, T, B, contiguous=contiguous, **flat)


def find_episodes(idx: StoreIndex) -> dict[int, Episode]:
    """Every episode id with at least one executed action in the complete epochs, in order of first step."""
    P, B = idx.episode_id.shape
    done = idx.terminated | idx.truncated
    executed = idx.step_mask.any(axis=-1)  # idle envs (auto_reset=false, episode over) ran nothing
    found: list[tuple[tuple[int, int], Episode]] = []
    for b in range(B):
        pos = np.flatnonzero(executed[:, b] & (idx.episode_id[:, b] >= 0))
        if pos.size == 0:
            continue
        ids = idx.episode_id[pos, b]
        order = np.argsort(ids, kind="stable")  # grouped by id, run order kept inside each group
        groups = np.split(pos[order], np.flatnonzero(np.diff(ids[order])) + 1)
        for g in groups:
            p0, eid = int(g[0]), int(idx.episode_id[g[0], b])
            run_first = p0 == 0 and int(idx.epochs[0]) == 0
            after_other = (p0 > 0 and bool(idx.contiguous[p0]) and int(idx.episode_id[p0 - 1, b]) != eid
                           and bool(done[p0 - 1, b]))
            ep = Episode(eid, b, int(idx.episode_seed[p0, b]), g.tolist(), run_first or after_other,
                         bool(done[g[-1], b]))
            found.append(((p0, b), ep))
    found.sort(key=lambda x: x[0])
    return {ep.id: ep for _, ep in found}


# ----------------------------------------------------------------------------------------------------------------
# replay
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class EpisodeData:
    """Stored obs [P_e, O], actions [P_e, C, D], rewards [P_e, C] of one env at the positions of an episode."""

    obs: dict[int, np.ndarray]
    actions: dict[int, np.ndarray]
    rewards: dict[int, np.ndarray]


def read_episode_data(store, idx: StoreIndex, ep: Episode) -> EpisodeData:
    pos = ep.positions + [ep.positions[-1] + 1]  # the next chunk step holds the observation after the last one
    pos = [p for p in pos if p < len(idx.epochs) * idx.T]
    ei = sorted({p // idx.T for p in pos})
    epochs = [int(idx.epochs[i]) for i in ei]
    local = {i: j for j, i in enumerate(ei)}
    arrays = {f: store.read(f, epochs)[:, :, ep.env] for f in ("obs", "actions", "rewards")}
    out = EpisodeData({}, {}, {})
    for p in pos:
        j, t = local[p // idx.T], p % idx.T
        out.obs[p], out.actions[p], out.rewards[p] = (arrays["obs"][j, t], arrays["actions"][j, t],
                                                      arrays["rewards"][j, t])
    return out


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))


def choose_start(ep: Episode, idx: StoreIndex, data: EpisodeData, reset_obs: np.ndarray) -> int | None:
    """Index into ep.positions of the episode's (last) reset in the store, or None when it is not in the store.

    Candidates, latest first: epoch starts (t = 0) after the first position, where a resumed run or a retried
    rollout restarts the episode from its seed, then the first position. A candidate is the reset when the seed's
    reset observation matches the stored observation there (<= TOLERANCE); the first position is also accepted when
    the store shows it follows another episode's end (the comparison then reports the mismatch).
    """
    for k in range(len(ep.positions) - 1, 0, -1):
        p = ep.positions[k]
        if p % idx.T == 0 and _max_abs(reset_obs, data.obs[p]) <= TOLERANCE:
            return k
    if ep.known_start or _max_abs(reset_obs, data.obs[ep.positions[0]]) <= TOLERANCE:
        return 0
    return None


def replay_episode(env, ep: Episode, idx: StoreIndex, data: EpisodeData, *, ignore_terminations: bool,
                   collect_actions: bool = False) -> dict:
    """Replay one episode in `env` (a tasks.envs SingleEnv) and compare with the store. Returns a report row.

    The row has `skipped` set (and no comparison) when the episode's start is not in the store.
    """
    reset_obs = env.reset(ep.seed)
    k0 = choose_start(ep, idx, data, reset_obs)
    e0, t0 = idx.epoch_t(ep.positions[0])
    row = {"episode": ep.id, "env": ep.env, "seed": ep.seed, "complete": ep.complete,
           "first_step": {"epoch": e0, "t": t0}, "notes": list(ep.notes)}
    if k0 is None:
        row["skipped"] = (f"its start predates the store's complete epochs (first stored step: epoch {e0}, chunk "
                          f"step {t0}); the reset cannot be replayed")
        return row
    if k0 > 0:
        e, t = idx.epoch_t(ep.positions[k0])
        row["notes"].append(f"restarted from its reset at epoch {e} (resumed run, retried rollout or "
                            f"auto_reset=false): replayed from there")
        row["first_step"] = {"epoch": e, "t": t}
    positions = ep.positions[k0:]
    for k in range(1, len(positions)):
        if positions[k] != positions[k - 1] + 1 or not idx.contiguous[positions[k]]:
            e, _ = idx.epoch_t(positions[k - 1])
            row["notes"].append(f"the store has a gap after epoch {e} (an incomplete epoch): replayed up to there")
            positions = positions[:k]
            row["complete"] = False
            break

    b = ep.env
    d_obs = _max_abs(reset_obs, data.obs[positions[0]])
    d_rew = 0.0
    flag_errors: list[str] = []
    length, ret_stored, ret_replay, success_once, success_end = 0, 0.0, 0.0, False, False
    actions_run: list[np.ndarray] = []
    obs_after: list[np.ndarray] = []
    for k, p in enumerate(positions):
        e, t = idx.epoch_t(p)
        acts = np.clip(data.actions[p], -1.0, 1.0).astype(np.float32)
        mask_s = idx.step_mask[p, b]
        C = acts.shape[0]
        rew = np.zeros(C, np.float32)
        mask = np.zeros(C, bool)
        term = trunc = succ = False
        obs = None
        for c in range(C):
            if not mask_s[c]:
                break
            obs, r, term, trunc, succ = env.step(acts[c])
            if ignore_terminations:
                term = False
            trunc = trunc and not term
            rew[c], mask[c] = r, True
            if collect_actions:
                actions_run.append(acts[c])
                obs_after.append(np.asarray(obs).copy())
            if term or trunc:
                break
        length += int(mask.sum())
        ret_replay += float(rew.sum())
        ret_stored += float(data.rewards[p][mask_s].sum())
        success_once |= bool(idx.success[p, b])
        success_end = bool(idx.success[p, b])
        d_rew = max(d_rew, _max_abs(rew, data.rewards[p]))
        stored = (mask_s.tolist(), bool(idx.terminated[p, b]), bool(idx.truncated[p, b]), bool(idx.success[p, b]))
        replayed = (mask.tolist(), bool(term), bool(trunc), bool(succ))
        if stored != replayed:
            names = ("step_mask", "terminated", "truncated", "success")
            diff = ", ".join(f"{n} stored {s} replayed {r}" for n, s, r in zip(names, stored, replayed) if s != r)
            flag_errors.append(f"epoch {e} chunk step {t}: {diff}")
        last = k == len(positions) - 1
        if term or trunc:
            if not last:
                flag_errors.append(f"epoch {e} chunk step {t}: the replayed episode ended, the stored one goes on")
            break
        nxt = p + 1
        if obs is not None and nxt in data.obs and int(idx.episode_id[nxt, b]) == ep.id and (
                not last or (nxt < len(idx.contiguous) and idx.contiguous[nxt])):
            d_obs = max(d_obs, _max_abs(obs, data.obs[nxt]))
    row.update(length=length, stored_return=ret_stored, replayed_return=ret_replay,
               success_once=success_once, success_at_end=success_end, max_abs_obs_diff=d_obs,
               max_abs_reward_diff=d_rew, flag_mismatches=flag_errors,
               verified=bool(d_obs <= TOLERANCE and d_rew <= TOLERANCE and not flag_errors))
    if collect_actions:
        row["_actions"], row["_obs_after"] = actions_run, obs_after
    return row


# ----------------------------------------------------------------------------------------------------------------
# video
# ----------------------------------------------------------------------------------------------------------------
def make_render_env(cfg, size: int | None):
    """A ManiSkill env like tasks.envs.maniskill.ManiSkillEnv's, plus render_mode="rgb_array"."""
    from tasks.envs.vulkan import FIX, VulkanMissingError, ensure_vulkan

    if cfg.simulator != "maniskill":
        raise ReplayInputError(f"--video supports the maniskill simulator only, the store's is {cfg.simulator!r}; "
                               "drop --video")
    ensure_vulkan()
    import gymnasium as gym
    _import_maniskill_quietly(cfg)
    kwargs = dict(obs_mode=cfg.obs_mode, control_mode=cfg.control_mode, reward_mode=cfg.reward_mode,
                  sim_backend="physx_cpu" if cfg.sim_backend == "cpu" else cfg.sim_backend,
                  render_mode="rgb_array", num_envs=1)
    if cfg.max_episode_steps:
        kwargs["max_episode_steps"] = cfg.max_episode_steps
    if size:
        kwargs["human_render_camera_configs"] = dict(width=size, height=size)
    try:
        return gym.make(cfg.env_id, **kwargs)
    except RuntimeError as exc:
        if "vk::" in str(exc) or "Vulkan" in str(exc):
            raise VulkanMissingError(f"Vulkan failed in SAPIEN ({exc}): {FIX}") from None
        raise


def _frame(env, caption: str) -> np.ndarray:
    img = env.render()
    img = img.cpu().numpy() if hasattr(img, "cpu") else np.asarray(img)
    img = np.ascontiguousarray(img.reshape(img.shape[-3:])[..., :3]).astype(np.uint8)
    try:
        from PIL import Image, ImageDraw

        im = Image.fromarray(img)
        draw = ImageDraw.Draw(im)
        draw.rectangle((0, 0, im.width, 14), fill=(0, 0, 0))
        draw.text((3, 2), caption, fill=(255, 255, 255))
        return np.asarray(im)
    except ImportError:  # pillow comes with imageio; captions are a nicety
        return img


def render_video(cfg, rows: list[dict], path: Path, size: int | None) -> dict:
    """Render the replayed episodes (rows with `_actions`) into one mp4 at the task's control frequency."""
    import imageio.v2 as imageio
    import torch
    from tqdm import tqdm

    t0 = time.perf_counter()
    print("replay: creating the render env (the first camera env in a process compiles shaders: 15-30 s on "
          "software Vulkan)", file=sys.stderr, flush=True)
    env = make_render_env(cfg, size)
    fps = float(getattr(env.unwrapped, "control_freq", 20) or 20)
    total = sum(len(r["_actions"]) + 1 for r in rows)
    d_obs = 0.0
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = imageio.get_writer(str(path), fps=fps, codec="libx264", quality=8, macro_block_size=1,
                                ffmpeg_log_level="error")
    try:
        with tqdm(total=total, desc="render", unit="frame", file=sys.stderr, dynamic_ncols=True) as bar:
            for r in rows:
                env.reset(seed=r["seed"])
                ret = 0.0
                writer.append_data(_frame(env, f"episode {r['episode']} seed {r['seed']} step 0"))
                bar.update(1)
                for i, (a, ref) in enumerate(zip(r["_actions"], r["_obs_after"]), start=1):
                    obs, rew, *_ = env.step(torch.from_numpy(a).reshape(1, -1))
                    ret += float(rew.reshape(-1)[0])
                    d_obs = max(d_obs, _max_abs(obs.reshape(-1).numpy(), ref))
                    writer.append_data(_frame(env, f"episode {r['episode']} seed {r['seed']} step {i} "
                                                   f"return {ret:.2f}"))
                    bar.update(1)
    finally:
        writer.close()
        env.close()
    out = {"path": str(path), "frames": total, "fps": fps, "seconds": round(time.perf_counter() - t0, 1),
           "render_env_max_abs_obs_diff": d_obs}
    return out


# ----------------------------------------------------------------------------------------------------------------
# command
# ----------------------------------------------------------------------------------------------------------------
def replay(store_path: Path, *, episode_ids: list[int] | None = None, num_episodes: int = DEFAULT_NUM_EPISODES,
           video: Path | None = None, video_size: int | None = None, progress: bool | None = None) -> dict:
    """Replay episodes of the store at `store_path`; returns the report (see module docstring).

    Raises:
        ReplayInputError: not a store, unknown or unreplayable episode id, nothing to replay.
    """
    from tqdm import tqdm

    store = open_store(store_path)
    attrs = store.attrs
    run_env, cfg_note = run_env_settings(store_path)
    cfg = env_config_from_store(attrs, run_env)
    idx = load_index(store)
    notes = [cfg_note] if cfg_note else []
    if len(idx.epochs) == 0:
        raise ReplayInputError(f"trajectory store {store_path} has no complete epoch yet; nothing to replay "
                               "(wait for the run's first training step to finish)")
    episodes = find_episodes(idx)
    if not cfg.auto_reset:
        notes.append("env.auto_reset=false: each rollout epoch restarts its episodes from their reset")

    if episode_ids:
        unknown = [i for i in episode_ids if i not in episodes]
        if unknown:
            known = list(episodes)
            sample = ", ".join(map(str, known[:8])) + (", ..." if len(known) > 8 else "")
            raise ReplayInputError(f"episode id {unknown[0]} is not in the complete epochs of {store_path} "
                                   f"(known ids: {sample}); pick one of those")
        selected = [episodes[i] for i in dict.fromkeys(episode_ids)]
        limit = None
    else:
        if num_episodes < 1:
            raise ReplayInputError(f"--num-episodes {num_episodes}: must be >= 1")
        selected = [ep for ep in episodes.values() if ep.complete]
        if not selected:
            raise ReplayInputError(f"no complete episode in the complete epochs of {store_path}; pass --episode ID "
                                   f"to replay a partial one (ids: {', '.join(map(str, list(episodes)[:8]))})")
        limit = num_episodes

    from tasks.envs import make_single_env
    from tasks.envs.vulkan import VulkanMissingError

    try:
        _import_maniskill_quietly(cfg)
        env = make_single_env(cfg)
    except VulkanMissingError as exc:
        raise ReplayInputError(str(exc)) from None
    O, D = store.fields["obs"].shape[-1], store.fields["actions"].shape[-1]
    if (env.obs_dim, env.action_dim) != (O, D):
        env.close()
        raise ReplayInputError(f"{cfg.env_id} ({cfg.obs_mode}, {cfg.control_mode}) gives obs/action dims "
                               f"{env.obs_dim}/{env.action_dim}, the store holds {O}/{D}: replay with the "
                               "ManiSkill version that wrote the run")
    rows: list[dict] = []
    skipped: list[dict] = []
    base_seed = attrs.get("base_seed")
    t0 = time.perf_counter()
    try:
        bar = tqdm(total=limit or len(selected), desc="replay", unit="episode", file=sys.stderr,
                   disable=(not progress) if progress is not None else None, dynamic_ncols=True)
        for ep in selected:
            if limit is not None and len(rows) >= limit:
                break
            if base_seed is not None and ep.seed != int(base_seed) + ep.id:
                ep.notes.append(f"stored seed {ep.seed} differs from the seed rule base_seed + id = "
                                f"{int(base_seed) + ep.id} (a custom seed_fn?): used the stored seed")
            data = read_episode_data(store, idx, ep)
            row = replay_episode(env, ep, idx, data, ignore_terminations=cfg.ignore_terminations,
                                 collect_actions=video is not None)
            if "skipped" in row:
                if limit is None:  # asked for by id
                    raise ReplayInputError(f"episode {ep.id} cannot be replayed from {store_path}: "
                                           f"{row['skipped']}; pick an episode that starts inside the store")
                skipped.append({"episode": ep.id, "reason": row["skipped"]})
                continue
            rows.append(row)
            bar.update(1)
        bar.close()
    finally:
        env.close()
    if not rows:
        raise ReplayInputError(f"no episode of {store_path} starts inside its complete epochs; "
                               "pass --episode ID of an episode that does")
    if limit is not None and len(rows) < limit:
        notes.append(f"only {len(rows)} complete episode(s) replayable, {limit} asked")

    report = {
        "store": str(store_path), "run_id": attrs.get("run_id"),
        "env": {"simulator": cfg.simulator, "env_id": cfg.env_id, "obs_mode": cfg.obs_mode,
                "control_mode": cfg.control_mode, "reward_mode": cfg.reward_mode, "sim_backend": cfg.sim_backend,
                "max_episode_steps": cfg.max_episode_steps, "ignore_terminations": cfg.ignore_terminations},
        "layout": {"T": store.T, "num_envs": store.num_envs, "num_action_chunks": store.fields["actions"].shape[0],
                   "complete_epochs": _ranges([int(e) for e in idx.epochs]),
                   "num_complete_epochs": len(idx.epochs), "epochs_allocated": store.num_steps},
        "tolerance": TOLERANCE, "replay_seconds": round(time.perf_counter() - t0, 2),
        "episodes": rows, "skipped": skipped, "notes": notes,
        "all_verified": all(r["verified"] for r in rows),
    }
    if video is not None:
        report["video"] = render_video(cfg, rows, video, video_size)
        if report["video"]["render_env_max_abs_obs_diff"] > TOLERANCE:
            notes.append(f"the render env's states differ from the replay's by up to "
                         f"{report['video']['render_env_max_abs_obs_diff']:.3g} (the video may not show exactly "
                         "the stored episode)")
    for r in rows:
        r.pop("_actions", None)
        r.pop("_obs_after", None)
    return report


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts: list[str] = []
    for x in xs:
        if parts and x == last + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{x}"
        else:
            parts.append(str(x))
        last = x
    return ", ".join(parts) or "none"


def format_report(rep: dict) -> str:
    e, lay = rep["env"], rep["layout"]
    lines = [f"replay of {rep['store']}",
             f"  {e['env_id']} ({e['simulator']}, obs {e['obs_mode']}, {e['control_mode']}, {e['reward_mode']}); "
             f"complete epochs {lay['complete_epochs']} of {lay['epochs_allocated']}, T={lay['T']}, "
             f"{lay['num_envs']} envs, {lay['num_action_chunks']} action(s) per chunk",
             ""]
    head = f"{'episode':>7} {'env':>4} {'seed':>6} {'length':>6}  {'status':<8} {'return':>8} {'success':>7}  " \
           f"{'max|Δobs|':>10} {'max|Δreward|':>12}  result"
    lines.append(head)
    for r in rep["episodes"]:
        lines.append(f"{r['episode']:>7} {r['env']:>4} {r['seed']:>6} {r['length']:>6}  "
                     f"{'complete' if r['complete'] else 'partial':<8} {r['stored_return']:>8.3f} "
                     f"{'yes' if r['success_once'] else 'no':>7}  {r['max_abs_obs_diff']:>10.3g} "
                     f"{r['max_abs_reward_diff']:>12.3g}  {'VERIFIED' if r['verified'] else 'MISMATCH'}")
    n_ok = sum(r["verified"] for r in rep["episodes"])
    lines += ["", f"{n_ok}/{len(rep['episodes'])} episodes verified (tolerance {rep['tolerance']:g}: max |Δobs| and "
                  f"max |Δreward| <= tolerance, flags equal) in {rep['replay_seconds']:.1f} s"]
    for r in rep["episodes"]:
        for m in r["flag_mismatches"][:5]:
            lines.append(f"  episode {r['episode']}: {m}")
        if len(r["flag_mismatches"]) > 5:
            lines.append(f"  episode {r['episode']}: ... {len(r['flag_mismatches']) - 5} more flag mismatches")
        for n in r["notes"]:
            lines.append(f"  episode {r['episode']}: {n}")
    for s in rep["skipped"]:
        lines.append(f"  skipped episode {s['episode']}: {s['reason']}")
    for n in rep["notes"]:
        lines.append(f"  note: {n}")
    if "video" in rep:
        v = rep["video"]
        lines.append(f"video: {v['path']} ({v['frames']} frames at {v['fps']:g} fps, rendered in {v['seconds']} s)")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.replay",
                                description="Re-simulate stored episodes from (seed, actions) and verify them "
                                            "against the trajectory store; optionally render a video.")
    p.add_argument("run_or_store", metavar="RUN_OR_STORE",
                   help="a trajectories.zarr, a run directory, or a run id (looked up under --run-root)")
    p.add_argument("--episode", type=int, action="append", metavar="ID",
                   help="episode id to replay (repeatable); default: the first --num-episodes complete episodes")
    p.add_argument("--num-episodes", type=int, default=DEFAULT_NUM_EPISODES, metavar="N",
                   help=f"how many complete episodes to replay by default (default {DEFAULT_NUM_EPISODES})")
    p.add_argument("--run-root", default="runs", help="where run ids are looked up (default: runs)")
    p.add_argument("--video", type=Path, metavar="PATH.mp4", help="render the replayed episodes to this mp4")
    p.add_argument("--video-size", type=int, metavar="PIXELS",
                   help="square frame size of the video (default: the task's render camera, 512 for PushCube)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _import_maniskill_quietly(cfg) -> None:
    """Import ManiSkill, then silence its logger (the import resets its level to INFO)."""
    if cfg.simulator == "maniskill":
        from tasks.envs.vulkan import ensure_vulkan

        ensure_vulkan()
        import mani_skill.envs  # noqa: F401
    _quiet()


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("mani_skill", "mani_skill "):  # ManiSkill 3.0.1 names its logger "mani_skill " (trailing space)
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet()
    try:
        if args.video is not None and args.video.suffix.lower() != ".mp4":
            raise ReplayInputError(f"--video {args.video}: give a path ending in .mp4")
        if args.video_size is not None and (args.video_size < 16 or args.video_size % 2):
            raise ReplayInputError(f"--video-size {args.video_size}: use an even number of pixels >= 16")
        store_path = resolve_store(args.run_or_store, args.run_root)
        report = replay(store_path, episode_ids=args.episode, num_episodes=args.num_episodes, video=args.video,
                        video_size=args.video_size)
    except ReplayInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0 if report["all_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
