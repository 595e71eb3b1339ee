"""Re-simulation of stored episodes: reset from the stored seed, apply the stored actions, compare.

Plain functions on a single env (`tasks.envs.make_single_env`: `reset(seed) -> obs`, `step(action) -> (obs, reward,
terminated, truncated, success)`) and the episode index of `storage.episodes`; no Dask, no store writes. The CLI is
`pipelines.replay` (its docstring says what is compared, the units and the tolerance).
"""
from __future__ import annotations

import numpy as np

from storage.episodes import Episode, EpisodeData, StoreIndex

TOLERANCE = 1e-5  # max |Δobs| and max |Δreward| of a VERIFIED episode (ManiSkill's CPU sim replays exactly: 0)


def env_config_from_store(attrs: dict, run_env: dict):
    """The env config (its family's class) that rebuilds the store's env: ids and modes from the store attrs,
    backend and flags from the run's saved env section, then what the family adds (`tasks.envs.config_from_store`:
    ManiSkill the robot's visual LOD of the images, so replay videos show the arm as the run rendered it; LIBERO
    the seed -> init state mapping)."""
    from tasks.envs import config_from_store
    common = dict(env_id=attrs["env_id"], obs_mode=attrs["obs_mode"], control_mode=attrs["control_mode"],
                  reward_mode=attrs["reward_mode"], sim_backend=run_env.get("sim_backend", "physx_cpu"),
                  max_episode_steps=attrs.get("max_episode_steps"),
                  ignore_terminations=bool(run_env.get("ignore_terminations", False)),
                  auto_reset=bool(run_env.get("auto_reset", True)))
    return config_from_store(attrs["simulator"], attrs, run_env, common)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))


def choose_start(ep: Episode, idx: StoreIndex, data: EpisodeData, reset_obs: np.ndarray) -> int | None:
    """Index into ep.positions of the episode's (last) reset in the store, or None when it is not in the store.

    Candidates, latest first: step starts (t = 0) after the first position, where a resumed run or a retried
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
    e0, t0 = idx.step_t(ep.positions[0])
    row = {"episode": ep.id, "env": ep.env, "seed": ep.seed, "complete": ep.complete,
           "first_step": {"step": e0, "t": t0}, "notes": list(ep.notes)}
    if k0 is None:
        row["skipped"] = (f"its start predates the store's complete steps (first stored step: step {e0}, chunk "
                          f"step {t0}); the reset cannot be replayed")
        return row
    if k0 > 0:
        e, t = idx.step_t(ep.positions[k0])
        row["notes"].append(f"restarted from its reset at step {e} (resumed run, retried rollout or "
                            f"auto_reset=false): replayed from there")
        row["first_step"] = {"step": e, "t": t}
    positions = ep.positions[k0:]
    for k in range(1, len(positions)):
        if positions[k] != positions[k - 1] + 1 or not idx.contiguous[positions[k]]:
            e, _ = idx.step_t(positions[k - 1])
            row["notes"].append(f"the store has a gap after step {e} (an incomplete step): replayed up to there")
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
        e, t = idx.step_t(p)
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
            flag_errors.append(f"step {e}, chunk step {t}: {diff}")
        last = k == len(positions) - 1
        if term or trunc:
            if not last:
                flag_errors.append(f"step {e}, chunk step {t}: the replayed episode ended, the stored one goes on")
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
