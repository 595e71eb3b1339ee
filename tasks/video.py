"""Eval videos: the first `runner.eval_videos` episodes of an evaluation, replayed on a rendering simulator
instance and written as mp4, one file per episode.

Why a replay: an eval env runs without ManiSkill's render camera (state obs; VLA envs capture their small sensor
image once per chunk step only), and on a CPU (lavapipe) a 256 px frame costs ~0.1-0.25 s, far more than a physics
step. So the eval keeps the executed actions of the episodes to film (`tasks.rollout.evaluate(..., keep_actions=k)`)
and one `eval_videos` node per evaluation replays them with `reset(seed)` + the same actions on an instance made
with `render_size` (`tasks.envs.make_single_env`): on the CPU simulator (seed, actions) reproduces an episode
in a fresh instance (tasks.envs.maniskill.adapter, "Determinism"), but the eval env has played earlier episodes and that
contact history can shift one slightly (measured: 1 of 90 filmed episodes, return 7.557 vs 7.547), which
`return_matches` checks against the eval's own return. Only the filmed episodes are rendered, never the others.

Frames: the reset frame, then one every `stride` executed actions and the last one (stride = the env task's
control frequency / MAX_FPS, rounded, at least 1: PushCube-v1's 20 Hz gives 2, so a 50-action episode is 26 frames
at 10 fps, real time). A frame is the costly part (a 256 px capture on lavapipe: ~0.3 s with both cores busy), so
halving the frames halves the cost. Each frame carries two caption lines: the env task, the eval's training step,
the episode (id, reset seed); the action index `t/L`, that action's reward, the return so far and whether the
episode has succeeded yet (success_once). Files: `<out_dir>/episode_<id>.mp4` (H.264 via imageio-ffmpeg).

The node never fails an evaluation: any error (no Vulkan, no ffmpeg, an adapter that cannot render) comes back
as `error` and the runner prints it in one line; the eval's metrics are unaffected.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from tasks import resident
from tasks.config import Config

CAPTION_PX = 24  # the caption bar's height: two lines of PIL's default font
MAX_FPS = 10.0  # frames per second of video at most (real time: the stride skips actions between frames)


def frame_steps(num_actions: int, control_freq: float) -> tuple[list[int], float]:
    """The action counts t (0 = the reset) after which a frame is rendered, and the video's fps.

    Every `stride` = max(1, round(control_freq / MAX_FPS)) actions, plus the last action: e.g. (50, 20 Hz) ->
    [0, 2, ..., 50] (26 frames) at 10 fps; (5, 10 Hz) -> [0, 1, ..., 5] at 10 fps."""
    stride = max(1, int(round(control_freq / MAX_FPS)))
    steps = list(range(0, num_actions + 1, stride))
    if steps[-1] != num_actions:
        steps.append(num_actions)
    return steps, control_freq / stride


def caption(frame: np.ndarray, lines: list[str]) -> np.ndarray:
    """`frame` (uint8 [H, W, 3]) with a black bar of `lines` (white text) on top; a new array, same shape."""
    from PIL import Image, ImageDraw

    im = Image.fromarray(np.ascontiguousarray(frame))
    draw = ImageDraw.Draw(im)
    draw.rectangle((0, 0, im.width, CAPTION_PX), fill=(0, 0, 0))
    for i, text in enumerate(lines[:2]):
        draw.text((3, 1 + 11 * i), text, fill=(255, 255, 255))
    return np.asarray(im)


def check_mp4_path(path: str | Path) -> None:
    """Pre-flight of an mp4 a command will write (`pipelines.replay --video`), before any simulation: the path
    ends in .mp4, is not a directory, and its directory exists or can be created: its nearest existing parent is a
    directory where files can be created (`storage.rundir.check_writable_dir`, the check `pipelines.eval --out`
    and `record.out` get; like them, the missing directories are created when the file is written). Creates
    nothing.

    Raises:
        ValueError: one line "why; fix" (the caller prefixes the option and the path).
    """
    from storage.rundir import check_writable_dir
    p = Path(path)
    if p.suffix.lower() != ".mp4":
        raise ValueError("give a path ending in .mp4")
    if p.is_dir():
        raise ValueError(f"{p} is a directory; give a file path ending in .mp4")
    check_writable_dir(p.absolute().parent)


def mp4_writer(path: Path, fps: float, quality: int):
    """imageio's writer of an H.264 mp4 at `path` (`fps` frames per second, imageio's `quality` 0-10), through the
    ffmpeg plugin named explicitly: without imageio-ffmpeg imageio would pick another plugin by the extension
    (seen on a machine without it: tifffile's writer, "unexpected keyword argument 'fps'").

    Raises:
        RuntimeError: imageio-ffmpeg is not installed (the message names the package).
    """
    import imageio.v2 as imageio
    try:
        import imageio_ffmpeg  # noqa: F401  (the ffmpeg binary ships in its wheel)
    except ImportError:
        raise RuntimeError("mp4 videos need the package imageio-ffmpeg (a dependency of this project: "
                           "pip install imageio-ffmpeg, or rerun scripts/setup.sh)") from None
    return imageio.get_writer(str(path), format="FFMPEG", fps=fps, codec="libx264", quality=quality,
                              macro_block_size=1, ffmpeg_log_level="error")


def write_episode_video(env, episode: dict, path: Path, title: str) -> dict:
    """Replay one episode on `env` (made with `render_size`) and write its mp4.

    Args:
        env: a SingleEnv with `render_frame()` (tasks.envs.make_single_env(cfg, render_size=S)).
        episode: an eval episode dict (tasks.envs.shard episode record) with "seed" and "actions" float32 [L, D]
            (the executed, clipped actions), "return" (the eval's return, for the check).
        path: the mp4 to write (parent folders are created).
        title: the first caption line's prefix (env task, step).

    Returns:
        {"path", "episode_id", "seed", "frames" (`frame_steps`), "fps", "return" (the replay's), "eval_return",
        "return_matches" (|replay - eval| <= 1e-4 * max(1, |eval|)), "success_once" (the replay's)}.
    """
    actions = np.asarray(episode["actions"], np.float32)
    steps, fps = frame_steps(len(actions), float(getattr(env, "fps", 20.0)))
    wanted = set(steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = f"{title} | episode {episode['episode_id']} (seed {episode['seed']})"
    env.reset(int(episode["seed"]))
    ret, success = 0.0, False
    writer = mp4_writer(path, fps, quality=7)
    try:
        writer.append_data(caption(env.render_frame(), [head, f"t 0/{len(actions)}"]))
        for t, a in enumerate(actions, start=1):
            _, r, _, _, succ = env.step(a)
            ret += r
            success |= succ
            if t in wanted:
                writer.append_data(caption(env.render_frame(), [
                    head, f"t {t}/{len(actions)}  reward {r:.3f}  return {ret:.2f}  "
                          f"success {'yes' if success else 'no'}"]))
    finally:
        writer.close()
    ev = float(episode["return"])
    return {"path": str(path), "episode_id": int(episode["episode_id"]), "seed": int(episode["seed"]),
            "frames": len(steps), "fps": fps, "return": ret, "eval_return": ev,
            "return_matches": abs(ret - ev) <= 1e-4 * max(1.0, abs(ev)), "success_once": bool(success)}


def eval_videos(cfg: Config, run_id: str, out_dir: str, step: int, *episode_lists: list[dict]) -> dict:
    """Task: the mp4s of the first `cfg.runner.eval_videos` episodes (by episode id) among the eval shards'
    episode lists that carry "actions"; the render instance stays resident on the worker (one per run and size:
    the first camera instance in a process compiles shaders, 15-30 s on software Vulkan). `out_dir` must exist
    (the driver makes it, `pipelines.runner`): one that is gone is the "error", never made again here.

    Returns:
        {"videos": [write_episode_video's dicts, in filming order: the render instance's current task first, then
        by task_id, then episode id], "seconds": wall time of this node (s), "setup_s": of which
        getting the render instance (its creation at the run's first eval: shader compile), "error": None or one
        line (nothing raised: see the module docstring)}.
    """
    from tasks.envs import make_single_env

    t0 = time.perf_counter()
    r = cfg.runner
    chosen = sorted((e for part in episode_lists for e in part if e.get("actions") is not None),
                    key=lambda e: e["episode_id"])[:r.eval_videos]
    videos, error, setup_s = [], None, 0.0
    try:
        if not chosen:
            raise RuntimeError("no eval episode carries its actions (GPU simulation keeps no action log: "
                               "env.sim_backend=physx_cuda episodes are not replayable on the CPU renderer)")
        if not Path(out_dir).is_dir():  # the driver made it; gone means the run dir was removed: not re-created
            raise FileNotFoundError(f"the video directory {out_dir} is gone (removed with the run directory?)")
        env, _ = resident.get_or_create(f"{run_id}/render/{r.eval_video_size}",
                                        lambda: make_single_env(cfg.env, render_size=r.eval_video_size))
        setup_s = time.perf_counter() - t0
        # a multi-task env (LIBERO) rebuilds its instance when a reset selects another task (seconds, ~1 GB): film
        # the episodes of the instance's current task first, then task by task (one rebuild per further task)
        current = getattr(env, "task_id", None)
        chosen.sort(key=lambda e: (e.get("task_id", current) != current, e.get("task_id", -1), e["episode_id"]))
        for e in chosen:
            videos.append(write_episode_video(env, e, Path(out_dir) / f"episode_{e['episode_id']}.mp4",
                                              f"{cfg.env.env_id} eval at step {step}"))
    except Exception as exc:  # noqa: BLE001 - a video never fails the evaluation (module docstring)
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return {"videos": videos, "seconds": time.perf_counter() - t0, "setup_s": setup_s, "error": error}


__all__ = ["caption", "check_mp4_path", "eval_videos", "frame_steps", "write_episode_video"]
