"""Does a ManiSkill CPU env's physics after `reset(seed)` depend on the episodes it ran before?

Why it matters: a resumed run builds its env shards fresh, an uninterrupted run keeps stepping envs that have run
every earlier episode. If the same (seed, actions) give other states in the two, a resumed run leaves the
uninterrupted one's trajectory (README, "Resume": measured, they do).

What it does: for each env of a stored run (its `trajectories.zarr`, auto_reset with one whole episode per env per
training step, as the default PushCube job stores), take the episode of training step `--step` and the `--history`
episodes before it (their reset seeds and executed actions), and replay the episode's actions

  (a) on a freshly built env (reset with the episode's seed, then its actions), and
  (b) on one env that first replayed the history episodes the same way;

and print how many episodes' observations differ at all, the first chunk step of each difference and its size.
Both replays are open-loop (the stored actions), so nothing but the env's own state can make them differ.

    .venv/bin/python benchmarks/env_history.py --store runs/pushcube_ppo/RUN/trajectories.zarr [--step 49]
        [--history 10] [--envs 64]

Measured (2026-12-05, 2-core VM, the default job with `seed=2 env.seed=200000`, step 49, 10 episodes of history,
174 s): 5 of 64 episodes differ, from action 9-17 on (first by 2e-7 to 1e-2, then up to 1.3 in a state entry): the
CPU simulator keeps solver and contact state across `reset`. ManiSkill's `reconfigure` reset (the scene rebuilt)
removed the difference (64 of 64 episodes equal to a fresh env's), at ~146 ms per reset against ~1.3 ms; re-adding
the cube and table to the PhysX scene after a reset (cheap) removed most of it but not all, replaying the last 1-2
episodes on a fresh env none of it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def replay(env, seed: int, actions):
    """Observations float32 [T, O] of `env` reset with `seed` then stepped with actions [T, D] (the last action is
    not stepped: obs[t] is the observation the stored action t was taken on)."""
    import numpy as np
    obs = [env.reset(seed)]
    for a in actions[:-1]:
        obs.append(env.step(a)[0])
    return np.stack(obs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="a run's trajectories.zarr (its config.yaml is next to it)")
    ap.add_argument("--step", type=int, default=None, help="training step of the replayed episode (default: last)")
    ap.add_argument("--history", type=int, default=10, help="episodes the long-lived env runs first")
    ap.add_argument("--envs", type=int, default=None, help="envs to test (default: all)")
    args = ap.parse_args()
    import numpy as np

    from pipelines.config import load_saved_config
    from storage.trajectories import DamagedStore, TrajectoryStore
    from tasks.envs.maniskill.adapter import ManiSkillEnv
    store = Path(args.store)
    cfg = load_saved_config(store.parent / "config.yaml")
    if cfg.env.simulator != "maniskill":
        sys.exit(f"error: {store}: env.simulator={cfg.env.simulator}; this check replays ManiSkill episodes")
    try:  # the store's verified read: a missing chunk file is one line (exit 2), not zeros replayed
        st = TrajectoryStore.open(store)
        n_steps, T, B = st.num_steps, st.T, st.num_envs
        done = set(st.complete_steps().tolist())
        ep = st.read("episode_id")  # [n_steps, T, B]; the complete steps' chunk files checked
    except DamagedStore as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if not (ep == ep[:, :1, :]).all():
        sys.exit(f"error: {store}: an episode spans training steps; this check needs one whole episode per env per "
                 f"step (auto_reset with rollout.chunk_steps = the episode length)")
    k = (n_steps if args.step is None else args.step) - 1  # store row of training step k + 1
    if not args.history <= k < n_steps:
        sys.exit(f"error: --step must be in {args.history + 1}..{n_steps} with --history {args.history}")
    rows = list(range(k - args.history, k + 1))
    if not done.issuperset(rows):
        sys.exit(f"error: {store}: training steps {[r + 1 for r in rows if r not in done]} are not complete in the "
                 f"store; pick another --step")
    try:
        seeds, actions = st.read("episode_seed", rows)[:, 0, :], st.read("actions", rows)  # [H+1, B], [H+1, T, B, C, D]
    except DamagedStore as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    envs = range(min(B, args.envs or B))
    t0, diffs = time.perf_counter(), []
    for e in envs:
        acts = actions[:, :, e].reshape(args.history + 1, -1, actions.shape[-1])  # chunk steps x C -> actions
        fresh = ManiSkillEnv(cfg.env)
        o_fresh = replay(fresh, int(seeds[-1, e]), acts[-1])
        fresh.close()
        old = ManiSkillEnv(cfg.env)
        for h in range(args.history):
            replay(old, int(seeds[h, e]), acts[h])
        o_old = replay(old, int(seeds[-1, e]), acts[-1])
        old.close()
        d = np.abs(o_fresh - o_old).max(axis=1)
        if d.max() > 0:
            t = int(np.argmax(d > 0))
            diffs.append((e, t, float(d[t]), float(d.max())))
    print(f"{store}: training step {k + 1}, {len(envs)} envs, {args.history} episodes of history, "
          f"{time.perf_counter() - t0:.0f} s")
    for e, t, first, most in diffs:
        print(f"  env {e}: differs from action {t} on ({first:.2e} there, {most:.2e} at most)")
    print(f"{len(diffs)} of {len(envs)} episodes differ between a fresh env and one with history")


if __name__ == "__main__":
    main()
