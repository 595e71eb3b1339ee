"""`python -m pipelines.replay RUN_OR_STORE [run_root=DIR] [--episodes IDS] [--num-episodes N] [--video X.mp4] [--json]`

The command only: parse, resolve and open the store, call. The store's episode index is storage.episodes, the
re-simulation of one episode tasks.replay (plain functions, no Dask).

Re-simulates episodes of a trajectory store from their reset seed and stored actions, and checks that the
simulator reproduces what the store recorded.

RUN_OR_STORE is a `trajectories.zarr` directory, a run directory holding one, or a run id looked up under
`run_root=DIR` (default `runs`; `--run-root DIR` is the same) as `<run_root>/*/<run id>`.

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
seed + actions in a fresh instance (MACHINE.md), so both are expected to be exactly 0 for an episode that ran in a
fresh instance (an eval's first round, a run's first episodes). A training env that ran earlier episodes keeps
solver and contact state across `reset` that a fresh instance lacks: a few of its episodes (5 of 64 at a default
run's step 49, `benchmarks/env_history.py`) part from the fresh replay once the robot touches the cube, and show
as MISMATCH with a matching reset though the store is intact; the report says so under the table.

Which steps belong to an episode: the store's `episode_id` per chunk step and env (episode k of global env g has
id g + k * num_envs); only complete steps (`TrajectoryStore.complete_steps()`) are read. An episode is complete
when its last stored chunk step has `terminated` or `truncated`, else partial (cut by the end of the store, or by a
missing step, after which it cannot be replayed). Its start must be in the store: the first stored chunk step is
the reset when it is the run's first chunk step, when the env's previous chunk step ended another episode, or when
the seed's reset observation equals the stored observation there. An episode restarted from its reset at a step
start (a resumed run, a retried rollout task, or `env.auto_reset=false`) is replayed from the last restart.
Episodes whose start predates the store's first complete step are skipped with a note.

Which episodes: `--episodes 0,3,10-12` (ids and inclusive ranges, comma-separated; `--episode` is the same option,
repeatable: `--episode 2 --episode 5-6`), replayed in the order given. Default (none given): `--num-episodes` (3)
complete episodes worth watching (`storage.episodes.worth_watching`, from the stored rewards and success flags):
the successful episode with the highest stored return, the failed one with the lowest, then alternately the
highest and lowest returns left; an episode that cannot be replayed (its start predates the store) gives way to
the next in that order. The report says why each was picked. No complete episode: the partial ones, with a note.

`--video PATH.mp4` renders the replayed episodes one after another (the reset frame, then one frame per executed
action, at the task's control frequency) from a second simulator instance created with `render_mode="rgb_array"`.
Rendering on software Vulkan is slow: the first camera env in a process takes 15-30 s, then ~0.1-0.2 s a frame.
The path is checked before anything is replayed (`tasks.video.check_mp4_path`): a path ending in .mp4, not a
directory, in a directory that exists or can be created in a writable one (created when the video is written, as
`pipelines.eval --out` and `record.out` create theirs; the report notes it).

A damaged store (a chunk file of a complete step missing, which zarr would read as zeros; a garbled chunk file; a
field's array metadata missing) is bad input, exit 2: the fields replay reads are checked when the store is opened
(`TrajectoryStore.check_files`), and a read that fails is traced to the chunk file it failed on. The store cannot
be trusted then: re-record the run or restore the store from a whole copy.

Examples:
  python -m pipelines.replay runs/pushcube_ppo/20261201-151530-98db            # 3 episodes worth watching
  python -m pipelines.replay 20261201-151530-98db run_root=/tmp/runs --episodes 0,3,10-12 --json  # a run id
  python -m pipelines.replay RUN --num-episodes 2 --video replay.mp4 --video-size 256

Exit codes: 0 every replayed episode verified, 1 otherwise, 2 bad input: a bad argument, a path that is not a store,
a damaged store, an unwritable --video path (one line `error: ...` on stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

# the store's episode index lives in storage.episodes, the re-simulation in tasks.replay (re-exported here)
from storage.episodes import (INDEX_FIELDS as _INDEX_FIELDS, Episode, EpisodeData, StoreIndex,  # noqa: F401
                              find_episodes, id_ranges, load_index, no_complete_note, read_episode_data,
                              stored_outcomes, worth_watching)
from pipelines.cli import quiet
# the input (store, run directory or run id; the checked store; the run's env section): pipelines.replay_input
from pipelines.replay_input import (CONFIG_FILE, STORE_DIR, ReplayInputError, _reading, open_store,  # noqa: F401
                                    read_fields, resolve_store, run_env_settings)
from tasks.replay import (TOLERANCE, _max_abs, choose_start, env_config_from_store,  # noqa: F401
                          replay_episode)

DEFAULT_NUM_EPISODES = 3


# ----------------------------------------------------------------------------------------------------------------
# video
# ----------------------------------------------------------------------------------------------------------------
VIDEO_SIZE = 512  # --video's default frame side (px): ManiSkill's own render camera size for PushCube


def render_video(cfg, rows: list[dict], path: Path, size: int | None) -> dict:
    """Render the replayed episodes (rows with `_actions`) into one mp4 at the task's control frequency, on the
    same rendering instance the eval videos use (`tasks.envs.make_single_env(cfg, render_size=...)`) with their
    captions (`tasks.video.caption`: episode, seed; action index, return so far, success so far).

    Raises:
        ReplayInputError: a simulator whose adapter renders no frames, no usable Vulkan driver, or no
            imageio-ffmpeg.
    """
    from tqdm import tqdm

    from tasks.config import ConfigError
    from tasks.envs import make_single_env
    from tasks.envs.errors import SimulatorUnavailable
    from tasks.video import caption, mp4_writer

    t0 = time.perf_counter()
    print("replay: creating the render env (the first camera env in a process compiles shaders: 15-30 s on "
          "software Vulkan)", file=sys.stderr, flush=True)
    try:
        _prepare_env(cfg)
        env = make_single_env(cfg, render_size=size or VIDEO_SIZE)
    except (ConfigError, SimulatorUnavailable) as exc:
        raise ReplayInputError(f"--video: {exc}; drop --video") from None
    fps = float(getattr(env, "fps", 20.0))
    total = sum(len(r["_actions"]) + 1 for r in rows)
    d_obs = 0.0
    created = make_parent(path)
    try:
        writer = mp4_writer(path, fps, quality=8)
    except RuntimeError as exc:  # imageio-ffmpeg missing
        env.close()
        raise ReplayInputError(f"--video: {exc}; drop --video") from None
    try:
        with tqdm(total=total, desc="render", unit="frame", file=sys.stderr, dynamic_ncols=True) as bar:
            for r in rows:
                head, n = f"episode {r['episode']} seed {r['seed']}", len(r["_actions"])
                env.reset(int(r["seed"]))
                ret, success = 0.0, False
                writer.append_data(caption(env.render_frame(), [head, f"t 0/{n}"]))
                bar.update(1)
                for i, (a, ref) in enumerate(zip(r["_actions"], r["_obs_after"]), start=1):
                    obs, rew, _, _, succ = env.step(np.asarray(a, np.float32))
                    ret, success = ret + rew, success or succ
                    d_obs = max(d_obs, _max_abs(obs, ref))
                    writer.append_data(caption(env.render_frame(), [
                        head, f"t {i}/{n}  return {ret:.2f}  success {'yes' if success else 'no'}"]))
                    bar.update(1)
    finally:
        writer.close()
        env.close()
    out = {"path": str(path), "frames": total, "fps": fps, "seconds": round(time.perf_counter() - t0, 1),
           "render_env_max_abs_obs_diff": d_obs}
    if created is not None:
        out["created_dir"] = str(created)
    return out


def make_parent(path: Path) -> Path | None:
    """Create the missing parent directories of `path` (checked up front by `tasks.video.check_mp4_path`);
    returns the topmost one created, None when the parent existed.

    Raises:
        ReplayInputError: it cannot be created after all (changed since the check).
    """
    parent = path.absolute().parent
    top = None
    for d in (parent, *parent.parents):
        if d.exists():
            break
        top = d
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReplayInputError(f"--video {path}: cannot create its directory {parent} ({exc.strerror or exc}); "
                               "choose a path in a writable directory") from None
    if top is not None:
        print(f"replay: created {top} for --video {path}", file=sys.stderr, flush=True)
    return top


# ----------------------------------------------------------------------------------------------------------------
# command
# ----------------------------------------------------------------------------------------------------------------
def replay(store_path: Path, *, episode_ids: list[int] | None = None, num_episodes: int = DEFAULT_NUM_EPISODES,
           video: Path | None = None, video_size: int | None = None, progress: bool | None = None) -> dict:
    """Replay episodes of the store at `store_path`; returns the report (see module docstring).

    Raises:
        ReplayInputError: not a store, a damaged store (`open_store`, `_reading`), unknown or unreplayable episode
            id, nothing to replay, --video's directory not creatable.
    """
    from tqdm import tqdm

    store = open_store(store_path)
    attrs = store.attrs
    run_env, cfg_note = run_env_settings(store_path)
    cfg = env_config_from_store(attrs, run_env)
    with _reading(store, _INDEX_FIELDS):
        idx = load_index(store)
    notes = [cfg_note] if cfg_note else []
    if len(idx.steps) == 0:
        raise ReplayInputError(f"trajectory store {store_path} has no complete step yet; nothing to replay "
                               "(wait for the run's first training step to finish)")
    episodes = find_episodes(idx)
    if not cfg.auto_reset:
        notes.append("env.auto_reset=false: each training step restarts its episodes from their reset")

    if episode_ids:
        unknown = [i for i in episode_ids if i not in episodes]
        if unknown:
            known = list(episodes)
            sample = ", ".join(map(str, known[:8])) + (", ..." if len(known) > 8 else "")
            raise ReplayInputError(f"episode id {unknown[0]} is not in the complete steps of {store_path} "
                                   f"(known ids: {sample}); pick one of those")
        selected = [episodes[i] for i in dict.fromkeys(episode_ids)]
        why: dict[int, str] = {}
        limit = None
    else:
        if num_episodes < 1:
            raise ReplayInputError(f"--num-episodes {num_episodes}: must be >= 1")
        complete = {i: ep for i, ep in episodes.items() if ep.complete}
        partial = not complete  # a store shorter than an episode (a smoke run's): its partial ones, noted below
        complete = complete or dict(episodes)
        with _reading(store, ["rewards"], idx.steps):
            outcomes = stored_outcomes(store, idx, complete)
        order = worth_watching(outcomes)
        selected, why = [complete[i] for i, _ in order], dict(order)
        limit = num_episodes

    from tasks.envs import make_single_env
    from tasks.envs.errors import SimulatorUnavailable

    try:
        _prepare_env(cfg)
        env = make_single_env(cfg)
    except SimulatorUnavailable as exc:
        raise ReplayInputError(str(exc)) from None
    if not episode_ids and partial:  # how long an episode is (tasks.envs.max_episode_steps) against the store
        from tasks.envs import max_episode_steps
        notes.append(no_complete_note(cfg.env_id, max_episode_steps(cfg), store.fields["actions"].shape[0],
                                      len(idx.steps), idx.T, list(episodes)))
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
            with _reading(store, ["obs", "actions", "rewards"], _episode_steps(idx, ep)):
                data = read_episode_data(store, idx, ep)
            row = replay_episode(env, ep, idx, data, ignore_terminations=cfg.ignore_terminations,
                                 collect_actions=video is not None)
            if "skipped" in row:
                if limit is None:  # asked for by id
                    raise ReplayInputError(f"episode {ep.id} cannot be replayed from {store_path}: "
                                           f"{row['skipped']}; pick an episode that starts inside the store")
                skipped.append({"episode": ep.id, "reason": row["skipped"]})
                continue
            with _reading(store, ["task_id", "trial_id"], idx.steps):
                _check_task_trial(store, row, env)
            if ep.id in why:
                row["picked"] = why[ep.id]
            rows.append(row)
            bar.update(1)
        bar.close()
    finally:
        env.close()
    if not rows:
        raise ReplayInputError(f"no episode of {store_path} starts inside its complete steps; "
                               "pass --episodes IDS of an episode that does")
    if limit is not None and len(rows) < limit:
        notes.append(f"only {len(rows)} complete episode(s) replayable, {limit} asked")

    report = {
        "store": str(store_path), "run_id": attrs.get("run_id"),
        "env": {"simulator": cfg.simulator, "env_id": cfg.env_id, "obs_mode": cfg.obs_mode,
                "control_mode": cfg.control_mode, "reward_mode": cfg.reward_mode, "sim_backend": cfg.sim_backend,
                "max_episode_steps": cfg.max_episode_steps, "ignore_terminations": cfg.ignore_terminations},
        "layout": {"T": store.T, "num_envs": store.num_envs, "num_action_chunks": store.fields["actions"].shape[0],
                   "complete_steps": id_ranges([int(e) for e in idx.steps]),
                   "num_complete_steps": len(idx.steps), "steps_allocated": store.num_steps},
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


def _episode_steps(idx: StoreIndex, ep: Episode) -> list[int]:
    """The steps `read_episode_data` reads for `ep`: those of its positions and of the one after."""
    P = len(idx.steps) * idx.T
    return sorted({int(idx.steps[p // idx.T]) for p in [*ep.positions, ep.positions[-1] + 1] if p < P})


def _check_task_trial(store, row: dict, env) -> None:
    """A multi-task store (LIBERO: fields task_id / trial_id): the replayed reset's (env.task_id, env.trial_id)
    against the stored ones at the episode's first replayed chunk step; a mismatch (the seed mapped to another
    init state than the run's: other mapping keys) makes the episode not verified. Sets row["task_id"],
    row["trial_id"] (the replayed ones) where the env reports them."""
    if getattr(env, "trial_id", None) is None:
        return
    e, t = row["first_step"]["step"], row["first_step"]["t"]
    stored = tuple(int(store.read(f, [e])[0, t, row["env"]]) for f in ("task_id", "trial_id"))
    replayed = (int(env.task_id), int(env.trial_id))
    row["task_id"], row["trial_id"] = replayed
    if stored != replayed:
        row["verified"] = False
        row["notes"].append(f"the seed reset to (task_id, trial_id) {replayed}, the store recorded {stored}")


def format_report(rep: dict) -> str:
    e, lay = rep["env"], rep["layout"]
    lines = [f"replay of {rep['store']}",
             f"  {e['env_id']} ({e['simulator']}, obs {e['obs_mode']}, {e['control_mode']}, {e['reward_mode']}); "
             f"complete steps {lay['complete_steps']} of {lay['steps_allocated']}, T={lay['T']}, "
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
    from tasks.envs import replay_mismatch_note
    note = replay_mismatch_note(e["simulator"]) if n_ok < len(rep["episodes"]) else None
    if note:
        lines.append(f"  {note}")
    picked = [f"{r['episode']} ({r['picked']})" for r in rep["episodes"] if "picked" in r]
    if picked:
        lines.append(f"  picked (no --episodes): {', '.join(picked)}")
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
        made = f"; created {v['created_dir']}" if "created_dir" in v else ""
        lines.append(f"video: {v['path']} ({v['frames']} frames at {v['fps']:g} fps, rendered in {v['seconds']} s"
                     f"{made})")
    return "\n".join(lines)


def parse_episodes(text: str) -> list[int]:
    """Episode ids from `0,3,10-12` (comma-separated ids and inclusive ranges, in the order written; repeats
    dropped later). Raises argparse.ArgumentTypeError naming the bad part."""
    out: list[int] = []
    for part in text.split(","):
        a, dash, b = part.strip().partition("-")
        try:
            lo = int(a)
            hi = int(b) if dash else lo
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} in {text!r} is not an id or a range A-B of ids; "
                                             f"e.g. --episodes 0,3,10-12") from None
        if lo < 0 or hi < lo:
            raise argparse.ArgumentTypeError(f"{part.strip()!r}: ids are >= 0 and a range A-B has A <= B")
        out += range(lo, hi + 1)
    return out


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return n


def _parser() -> argparse.ArgumentParser:
    from pipelines.cli import ArgumentParser, examples
    p = ArgumentParser(prog="python -m pipelines.replay", epilog=examples(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Re-simulate stored episodes from (seed, actions) and verify them against the "
                                   "trajectory store; optionally render a video.")
    p.add_argument("run_or_store", metavar="RUN_OR_STORE",
                   help="a trajectories.zarr, a run directory, or a run id (under run_root=DIR, default runs)")
    p.add_argument("--episodes", "--episode", dest="episodes", type=parse_episodes, action="append", metavar="IDS",
                   help="episode ids and ranges, e.g. 0,3,10-12 (repeatable); default: --num-episodes complete "
                        "episodes worth watching (the highest-return success, the lowest-return failure, then "
                        "alternately the highest and lowest returns left)")
    p.add_argument("--num-episodes", type=_positive, default=DEFAULT_NUM_EPISODES, metavar="N",
                   help=f"how many episodes to pick by default (default {DEFAULT_NUM_EPISODES})")
    p.add_argument("--run-root", default="runs", help=argparse.SUPPRESS)  # run_root=DIR (pipelines.cli.as_flags)
    p.add_argument("--video", type=Path, metavar="PATH.mp4", help="render the replayed episodes to this mp4")
    p.add_argument("--video-size", type=int, metavar="PIXELS",
                   help="square frame size of the video (default: the task's render camera, 512 for PushCube)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    from pipelines.cli import version
    p.add_argument("--version", action="version", version=version())
    return p


def _prepare_env(cfg) -> None:
    """Make this process ready for cfg's simulator (`tasks.envs.prepare_process`: ManiSkill finds Vulkan and
    registers its tasks), then silence the simulators' loggers (an import resets their level)."""
    from tasks.envs import prepare_process
    prepare_process(cfg)
    quiet()
    from pipelines.cli import check_interrupted
    check_interrupted()  # a Ctrl-C during the import that trimesh swallowed (its optional imports)


def _check_video(path: Path) -> None:
    """--video's path, before anything is replayed (`tasks.video.check_mp4_path`).

    Raises:
        ReplayInputError: not a .mp4, a directory, or not creatable in a writable directory (one line).
    """
    from tasks.video import check_mp4_path
    try:
        check_mp4_path(path)
    except ValueError as exc:
        raise ReplayInputError(f"--video {path}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.replay ...` (module docstring). Returns the exit code."""
    from pipelines.cli import parse_words
    args = parse_words(_parser(), argv, ("run_root",))  # run_root=DIR, the spelling of every command
    if isinstance(args, int):
        return args
    quiet()
    try:
        if args.video is not None:
            _check_video(args.video)
        if args.video_size is not None and (args.video_size < 16 or args.video_size % 2):
            raise ReplayInputError(f"--video-size {args.video_size}: use an even number of pixels >= 16")
        store_path = resolve_store(args.run_or_store, args.run_root)
        ids = [i for spec in args.episodes or [] for i in spec] or None
        report = replay(store_path, episode_ids=ids, num_episodes=args.num_episodes, video=args.video,
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
    from pipelines.cli import entry
    sys.exit(entry(main))
