"""Record a teacher's episodes with images: `python -m pipelines.record conf=NAME record.teacher=RUN`.

RUN is a run directory (runs/<experiment>/<run_id>) or a run id under `run_root`; its resolved config.yaml and
latest checkpoint give the teacher policy. `record.teacher=scripted:libero` records LIBERO's
scripted pick-and-place expert instead (tasks/envs/libero/expert.py: it acts from the simulator's object poses;
tasks whose goal is one object in/on a target, e.g. every libero_object and libero_spatial task; conf=libero_record).
The config being composed (e.g. conf/conf/pushcube_record.yaml) gives the env of the recording (obs_mode=rgb, image_size, seeds, num_envs/num_shards) and the stored chunk
length `policy.num_action_chunks` (the student's C). One graph per round: `record_s{s}` nodes, one per env
shard on its env worker, each running one episode per env and writing its zarr region (tasks.demos).

Output: a trajectory store (default `<run_root>/demos/<experiment>.zarr`, refused if it exists; written under
`<out>.partial` and renamed when complete, so an interrupted recording leaves nothing at the output path) whose
attributes name the teacher, count the successful episodes and list every episode (`episode_index`: episode_id, seed,
task_id, trial_id, success_once, episode_len; task_id 0 / trial_id -1 on simulators without stored init states); `algorithm.name=sft sft.store=PATH` trains on it.
Exit codes as pipelines.run: 0 done, 2 bad config / teacher / output path, or an output directory that cannot
be written (checked before any worker starts; one line), another recording to the same output or a live run
reading it as sft.store (one writer per store: `<out>.lock`, `storage.rundir.lock_store`; the line names it), an unknown flag or a word that is not an override,
1 failure, 130 interrupted.

Examples:
  python -m pipelines.record conf=pushcube_record record.teacher=runs/pushcube_ppo/20261201-151530-98db
  python -m pipelines.record conf=pushcube_record record.teacher=20261201-151530-98db record.num_episodes=64 \\
      record.out=runs/demos/small.zarr
  python -m pipelines.record conf=libero_record record.teacher=scripted:libero env.task_ids=[0,1]
  python -m pipelines.validate conf=pushcube_record record.teacher=RUN       # its checks only, nothing recorded
"""
from __future__ import annotations

import sys
import time
from pathlib import Path


def record(cfg, handle, *, echo=print, lock=None) -> dict:
    """Record `record.num_episodes` (rounded up to whole rounds) teacher episodes. Returns a summary dict.

    `lock`: the output store's lock when the caller took it (`storage.rundir.lock_store`, main: before the
    cluster starts); else taken here, before anything is written, and released at the end. One recording per
    output path, and none into a store a live run reads (sft.store).

    Raises:
        tasks.config.ConfigError (key record.out): another recording writes the path, or a live run reads it."""
    import numpy as np
    from tqdm import tqdm

    from pipelines.clusters import plan_placement
    from pipelines.config import check_record, record_output_path, resolve_teacher, teacher_config
    from pipelines.graphs import GraphBuilder
    from pipelines.runner.watcher import Watcher
    from storage.trajectories import TrajectoryStore
    from tasks import demos, resident, trajectory
    from tasks.envs import gripper_convention, is_scripted_teacher, store_attrs
    from tasks.rollout import env_dims
    from tasks.seeding import RECORD_SEED_RULE

    check_record(cfg)
    if is_scripted_teacher(cfg.record.teacher):  # no run: the expert acts from the simulator's state
        run_dir, ckpt, tcfg = cfg.record.teacher, None, None
    else:
        run_dir, ckpt = resolve_teacher(cfg.record.teacher, cfg.run_root)  # its files verified by check_record
        tcfg = teacher_config(run_dir)
    out = record_output_path(cfg)
    if lock is None:
        with _store_lock(out) as own:
            return record(cfg, handle, echo=echo, lock=own)
    client = handle.client
    placement = plan_placement(cfg, client)
    watch = Watcher(cfg, client, placement)  # every wait watched: a lost or stalled worker ends it (RunStalled)
    dims = watch.results([client.submit(env_dims, cfg, workers=[placement.shard_workers[0]], pure=False)],
                         "the env_dims task")[0]
    fields = trajectory.record_schema(trajectory.Dims.from_config(cfg, *dims))
    T = demos.chunk_steps_per_episode(cfg)
    rounds = -(-cfg.record.num_episodes // cfg.env.num_envs)
    out.parent.mkdir(parents=True, exist_ok=True)
    # written under `<out>.partial` and renamed to `out` once complete: an interrupted or failed recording leaves
    # no store at `out` that sft.store could take for a finished one (an earlier one's partial store is replaced)
    partial = partial_path(out)
    if partial.exists():
        import shutil
        echo(f"dagrl record: removing {partial} (an earlier recording to {out} that did not finish)")
        shutil.rmtree(partial)
    store = TrajectoryStore.create(partial, fields=fields, T=T, num_envs=cfg.env.num_envs,
                                   shard_size=cfg.env.shard_size,
                                   attrs={"env_id": cfg.env.env_id, "simulator": cfg.env.simulator,
                                          "obs_mode": cfg.env.obs_mode, "control_mode": cfg.env.control_mode,
                                          "reward_mode": cfg.env.reward_mode, "base_seed": cfg.env.seed,
                                          "sim_backend": cfg.env.sim_backend, "auto_reset": False,
                                          "ignore_terminations": cfg.env.ignore_terminations,
                                          "seed_rule": RECORD_SEED_RULE,
                                          "num_action_chunks": cfg.policy.num_action_chunks,
                                          "max_episode_steps": cfg.env.max_episode_steps,
                                          "gripper_convention": gripper_convention(cfg.env),
                                          **store_attrs(cfg.env),
                                          "teacher_run": str(run_dir),
                                          "teacher_checkpoint": None if ckpt is None else str(ckpt),
                                          "deterministic": cfg.record.deterministic,
                                          "action_noise": cfg.record.action_noise})
    episodes: list[dict] = []
    t0 = time.perf_counter()
    bar = tqdm(total=rounds * cfg.env.num_envs, desc="record", unit="episode", dynamic_ncols=True,
               disable=not cfg.runner.progress)
    import uuid
    rec_id = f"{cfg.experiment}-{uuid.uuid4().hex[:8]}"  # graph keys and resident shards of this recording only
    try:
        for r in range(rounds):
            store.reserve(r)
            g = GraphBuilder()
            keys = [g.add(f"record_s{s}-{rec_id}-{r}", demos.record_round, cfg, tcfg, ckpt and str(ckpt), s, r,
                          str(partial), rec_id, worker=placement.shard_workers[s], resources={"CPU": 1})
                    for s in range(cfg.env.num_shards)]
            results = watch.results(client.get(g.graph(), keys, sync=False), f"record round {r}")
            store.mark_complete(r, global_step=r)
            new = [e for res in results for e in res["episodes"]]
            episodes += new
            bar.update(len(new))
            bar.set_postfix(success=f"{np.mean([e['success_once'] for e in episodes]):.2f}")
    finally:
        bar.close()
        try:  # this recording's env shards and experts (a cluster that outlives the command keeps no simulator)
            client.run(resident.release, f"record/{rec_id}/")
        except Exception:  # noqa: BLE001 - a cluster gone or a lost worker frees them anyway
            pass
    n_succ = int(sum(e["success_once"] for e in episodes))
    index = [{"episode_id": e["episode_id"], "seed": e["seed"], "success_once": e["success_once"],
              "episode_len": e["episode_len"], "task_id": e["task_id"], "trial_id": e["trial_id"]}
             for e in sorted(episodes, key=lambda e: e["episode_id"])]
    per_task: dict[int, list[int]] = {}
    for e in index:
        per_task.setdefault(e["task_id"], [0, 0])
        per_task[e["task_id"]][0] += int(e["success_once"])
        per_task[e["task_id"]][1] += 1
    summary = {"per_task": {t: tuple(v) for t, v in sorted(per_task.items())}, "store": str(out),
               "episodes": len(episodes), "successful": n_succ,
               "success_rate": n_succ / max(1, len(episodes)), "seconds": time.perf_counter() - t0,
               "teacher": str(run_dir), "checkpoint": ckpt and str(ckpt)}
    store.update_attrs(episodes=len(episodes), successful_episodes=n_succ, episode_index=index)
    partial.rename(out)  # atomic on one filesystem: `out` appears complete or not at all
    return summary


def _store_lock(out):
    """`storage.rundir.lock_store(out)` (exclusive; `partial_path(out)` shares its lock file), a busy one as
    ConfigError naming the holder."""
    from storage.locks import LockBusy
    from storage.rundir import lock_store
    from tasks.config import ConfigError
    try:
        return lock_store(out)
    except LockBusy as exc:
        raise ConfigError("record.out", str(out), str(exc)) from None


def preflight_writes(cfg) -> list[tuple[str, str, Path]]:
    """`pipelines.cli.preflight`'s `writes` of a recording: the directory the store is written in, named by the
    key that put it there (`record.out`, else `run_root`). pipelines.validate checks the same."""
    from pipelines.config import record_output_path
    out = record_output_path(cfg)
    key, value = ("record.out", cfg.record.out) if cfg.record.out else ("run_root", cfg.run_root)
    return [(key, value, out.parent)]


def partial_path(out):
    """Where `record` writes the store for `out` until it is complete: `<out>.partial` (a Path)."""
    from pathlib import Path
    out = Path(out)
    return out.with_name(out.name + ".partial")


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.record ...` (module docstring). Returns the exit code."""
    from pipelines.cli import load, overrides_and_flags, preflight, with_cluster
    words = overrides_and_flags(argv, __doc__, "python -m pipelines.record")
    if isinstance(words, int):
        return words
    cfg = load(words[1], command="record")  # the shared check path, incl. check_record
    if cfg is None:
        return 2
    if not preflight(cfg, tracking=False, writes=preflight_writes(cfg)):  # before any worker starts
        return 2
    from pipelines.config import record_output_path
    from tasks.config import ConfigError
    try:  # one writer per output store, taken before the cluster starts (a second recording: one line, exit 2)
        lock = _store_lock(record_output_path(cfg))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def body(handle) -> int:
        print(f"dagrl record: dashboard {handle.dashboard_link}", flush=True)
        s = record(cfg, handle, lock=lock)
        tasks = ", ".join(f"task {t}: {k}/{n}" for t, (k, n) in s["per_task"].items())
        print(f"dagrl record: {s['episodes']} episodes ({s['successful']} successful, {s['success_rate']:.2f}; "
              f"{tasks}) in {s['seconds']:.0f}s -> {s['store']}")
        return 0
    with lock:
        return with_cluster(cfg, body)

if __name__ == "__main__":
    from pipelines.cli import entry
    sys.exit(entry(main))
