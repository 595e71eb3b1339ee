"""Demonstrations: recording a trained teacher's episodes with images, and behaviour cloning (SFT) from a store.

Recording (pipelines.record): a state-based teacher (e.g. the PPO MLP of the main job, C=1) acts at every
simulator step, closed loop; its actions are grouped into stored chunks of C = `policy.num_action_chunks` (the
student's chunk length) with the image and state at the start of each chunk. The store therefore has exactly the
layout of a rollout of the student ([E, T, B] with actions [C, D], step_mask [C], rgb [H, W, 3]), E = recording
round (one episode per env per round), T = ceil(max_episode_steps / C). Images are rendered once per stored chunk.

SFT (algorithm.name=sft): the samples are the chunk steps (e, t, b) of the selected episodes (successful ones by
default) with at least one executed action; actions after an episode's end inside a chunk are zeros (for
delta-position control: hold still).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from tasks import resident
from tasks.demo_index import SFT_FIELDS, set_demo_stats, sft_index  # noqa: F401 (re-exported)
from tasks.config import Config
from tasks.device import autocast, to_device
from tasks.envs import make_shard
from tasks.policies import make_policy
from tasks.prompts import instructions, policy_obs
from tasks.rollout import num_values


def chunk_steps_per_episode(cfg: Config) -> int:
    """T of a recording: ceil(max_episode_steps / C) (the adapter's default episode length unless set)."""
    from tasks.envs import max_episode_steps
    return -(-max_episode_steps(cfg.env) // cfg.policy.num_action_chunks)


def _teacher(teacher_cfg: Config, checkpoint_path: str, obs_dim: int, action_dim: int) -> torch.nn.Module:
    def build():
        from storage.checkpoints import load_checkpoint, played_policy_key
        pol = make_policy(teacher_cfg.policy, obs_dim=obs_dim, action_dim=action_dim,
                          num_values=num_values(teacher_cfg), load=False)
        key = played_policy_key(checkpoint_path)  # the weights its evals scored (the average, if kept)
        pol.load_state_dict(load_checkpoint(checkpoint_path, keys=(key,))[key])  # weights only
        return pol.eval()
    pol, _ = resident.get_or_create(f"teacher/{checkpoint_path}", build)
    return pol


def record_round(cfg: Config, teacher_cfg: Config | None, checkpoint_path: str | None, shard: int, round_idx: int,
                 store_path: str, recording: str | None = None) -> dict:
    """Record one episode per env of shard `shard` (round `round_idx`) into the store's step `round_idx`.

    `recording`: this recording's id (pipelines.record: unique per invocation), the name of its resident env shard
    and expert (default: `store_path`). A second recording to the same path on the same workers (an interrupted
    one repeated) must start from round 0's episodes, not continue the first one's shard.

    `teacher_cfg` None: the scripted expert `cfg.record.teacher` (`scripted:NAME`, tasks.envs.SCRIPTED_TEACHERS)
    acts, one resident instance per shard; else the policy of `teacher_cfg` loaded from `checkpoint_path`.

    Returns {"episodes": finished-episode dicts (see EnvShard.chunk_step), "seconds": float}.
    """
    t0 = time.perf_counter()
    from storage.trajectories import write_shard
    e, C = cfg.env, cfg.policy.num_action_chunks
    rec_id = recording or store_path
    sh, _ = resident.get_or_create(f"record/{rec_id}/shard/{shard}", lambda: make_shard(
        e, shard=shard, num_shards=e.num_shards, num_envs=e.num_envs, auto_reset=False,
        ignore_terminations=e.ignore_terminations, base_seed=e.seed))
    if teacher_cfg is None:
        from tasks.envs import make_scripted_teacher
        expert, _ = resident.get_or_create(
            f"record/{rec_id}/expert/{shard}",
            lambda: make_scripted_teacher(cfg.record.teacher, sh, cfg.record.action_noise))

        def act(state):
            return expert.act(sh)  # [B, 1, D]: from the simulator's state, not the observation
    else:
        teacher = _teacher(teacher_cfg, checkpoint_path, sh.obs_dim, sh.action_dim)

        def act(state):
            with torch.no_grad():
                return teacher.act({"state": torch.from_numpy(state)},
                                   deterministic=cfg.record.deterministic)["actions"][:, :1].numpy()  # [B, 1, D]
    B, D, T = sh.num_envs, sh.action_dim, chunk_steps_per_episode(cfg)
    sh.begin_rollout()  # DISABLED lifecycle (auto_reset=False): round k starts episode k in every env
    state, rgb = sh.current_obs(), sh.current_rgb()
    rows: dict[str, list] = {}
    episodes: list[dict] = []
    for _ in range(T):
        seeds, ids = sh.current_episodes()
        task, trial = sh.current_tasks()
        rec = {"obs": state, "rgb": rgb, "task_id": task, "trial_id": trial, "actions": np.zeros((B, C, D), np.float32),
               "rewards": np.zeros((B, C), np.float32), "step_mask": np.zeros((B, C), bool),
               "terminated": np.zeros(B, bool), "truncated": np.zeros(B, bool), "success": np.zeros(B, bool),
               "episode_seed": seeds, "episode_id": ids}
        for c in range(C):
            if not sh.active.any():
                break
            a = act(state)
            res = sh.chunk_step(a, render=c == C - 1)
            done_mask = res.step_mask[:, 0]
            rec["actions"][:, c] = np.where(done_mask[:, None], np.clip(a[:, 0], -1, 1), 0.0)
            rec["rewards"][:, c] = res.rewards[:, 0]
            rec["step_mask"][:, c] = done_mask
            rec["terminated"] |= res.terminated
            rec["truncated"] |= res.truncated
            rec["success"] = np.where(done_mask, res.success, rec["success"])
            episodes += res.episodes
            state = res.obs
            if res.rgb is not None and c == C - 1:
                rgb = res.rgb
        for k, v in rec.items():
            rows.setdefault(k, []).append(v)
    data = {k: np.stack(v) for k, v in rows.items()}
    write_shard(store_path, step=round_idx, shard=shard, data=data)
    return {"episodes": episodes, "seconds": time.perf_counter() - t0}


# ----- SFT -----

def chunk_returns(rewards: np.ndarray, step_mask: np.ndarray, truncated: np.ndarray, gamma: float,
                  reward_scale: float = 1.0) -> np.ndarray:
    """Discounted chunk-level returns of recorded episodes (the critic's warm-start targets).

    Args:
        rewards: float [T, B, C] per-action rewards of one recording round (one episode per env, starting at t=0).
        step_mask: bool [T, B, C] executed actions. truncated: bool [T, B] the episode hit the time limit there.
        gamma: discount per chunk step (algorithm.gamma). reward_scale: algorithm.reward_scale.

    Returns float32 [T, B]: G_t = r_t + gamma G_{t+1} with r_t = reward_scale * (sum of the chunk's executed
    rewards). An episode cut by the time limit is bootstrapped as if its last chunk reward went on for ever
    (G_end = r_last / (1 - gamma)), the stationary value PPO's truncation bootstrap converges to when the state no
    longer changes (ignore_terminations: the cube stays where it is); a terminated episode's tail is 0.
    """
    T, B = rewards.shape[:2]
    r = reward_scale * np.where(step_mask, rewards, 0.0).sum(-1)  # [T, B]
    alive = step_mask.any(-1)  # [T, B]
    out = np.zeros((T, B), np.float32)
    for b in range(B):
        steps = np.flatnonzero(alive[:, b])
        if not len(steps):
            continue
        last = steps[-1]
        g = r[last, b] / (1.0 - gamma) if truncated[last, b] and gamma < 1 else 0.0
        for t in range(last, -1, -1):
            g = r[t, b] + gamma * g
            out[t, b] = g
    return out


def rows_in(rows: np.ndarray, subset: np.ndarray) -> np.ndarray:
    """bool [M]: whether each (step, t, b) row of `rows` (int [M, 3], non-negative) is also a row of `subset`
    (int [K, 3]). Linear in M + K (each row as one flat index, `np.isin`): the pairwise comparison it replaces held
    M x K x 3 booleans, 17 GB for the 62k x 92k chunk steps of a 36-step, 256-env RL run's store used as
    `sft.store` (the SFT workers were killed on every retry)."""
    if not len(rows) or not len(subset):
        return np.zeros(len(rows), bool)
    dims = tuple(int(d) + 1 for d in np.maximum(rows.max(0), subset.max(0)))
    return np.isin(np.ravel_multi_index(rows.T, dims), np.ravel_multi_index(subset.T, dims))


def gather(st, field: str, rows: np.ndarray) -> np.ndarray:
    """`field` of the TrajectoryStore `st` at the (step, t, b) rows (int [M, 3]): [M, *field shape], in the rows'
    order (`TrajectoryStore.gather`: the store's verified read, one step at a time, so the peak is the result plus
    one step's field; reading the whole field first held every step of a large store twice over;
    `tasks.demo_index.sft_dataset_bytes` estimates this peak).

    Raises:
        DamagedStore: a chunk file of a needed step missing or undecodable (zarr would read a missing one as zeros).
    """
    return st.gather(field, rows)


def _dataset(cfg: Config) -> dict[str, np.ndarray]:
    """The samples in memory, cached per worker: obs [M, O], rgb [M, H, W, 3] (if stored), actions [M, C, D].

    With `sft.value_coef` > 0 the samples are the chunk steps of every recorded episode, with `bc` bool [M] (the
    behaviour-cloning selection, `sft.only_success`) and `returns` float32 [M] (`chunk_returns`).

    Every field is read through the store's verified read (`TrajectoryStore.read` / `gather`).

    Raises:
        DamagedStore: a chunk file of a field it reads missing or undecodable at a complete step (one line naming
            the store, the field, the chunk file, its step and envs, and the fix); `pipelines.config` checks the
            same files (`sft_fields`) before a run starts."""
    store_path, only_success, value = cfg.sft.store, cfg.sft.only_success, cfg.sft.value_coef > 0

    def load():
        from storage.trajectories import TrajectoryStore
        st = TrajectoryStore.open(store_path)
        rows = sft_index(store_path, only_success and not value)
        out = {}
        for k in SFT_FIELDS:  # rgb: image stores only
            if k in st.fields:
                out[k] = gather(st, k, rows)
        if value:
            bc = sft_index(store_path, only_success)
            out["bc"] = rows_in(rows, bc)  # [M]
            steps = np.asarray(st.complete_steps(), np.int64)
            rewards, mask, trunc = st.read("rewards", steps), st.read("step_mask", steps), st.read("truncated", steps)
            rets = np.stack([chunk_returns(rewards[i], mask[i], trunc[i], cfg.algorithm.gamma,
                                           cfg.algorithm.reward_scale) for i in range(len(steps))])  # [N, T, B]
            pos = np.searchsorted(steps, rows[:, 0])
            out["returns"] = rets[pos, rows[:, 1], rows[:, 2]]
        return out
    data, _ = resident.get_or_create(f"sft_data/{store_path}/{only_success}/{value}", load)
    return data


def sft_load(cfg: Config, seed: int, num_batches: int) -> list[dict[str, np.ndarray]]:
    """`num_batches` random minibatches of `sft.batch_size` samples (a data node; seeded, so reproducible)."""
    data = _dataset(cfg)
    rng = np.random.default_rng(seed)
    M = len(data["actions"])
    return [{k: v[idx] for k, v in data.items()}
            for idx in (rng.integers(0, M, cfg.sft.batch_size) for _ in range(num_batches))]


def sft_update(cfg: Config, run_id: str, weights: dict, *batch_lists: list[dict]) -> dict:
    """Behaviour-cloning gradient steps on the resident actor (`policy.sft_loss`), one per minibatch; returns
    new versioned weights and metrics (train/sft_loss, train/grad_norm: means over the applied steps, NaN if none).

    Each loaded minibatch is stepped once (the loaders draw them: no epochs or permutation here) by
    `tasks.actor.optim.optimizer_step`, the step rule of every actor update: a step whose loss or gradient norm is
    non-finite is skipped (no optimizer step: parameters and optimizer state unchanged), counted in
    `train/skipped_updates`; the torch draws of the
    loss (e.g. the flow VLA's noise and time samples) come from generators forked and seeded with
    `update_seed(cfg, version, 0)` (`tasks.actor.loop.update_rng`), so a resumed run draws what the uninterrupted one
    did and the process's own streams are untouched."""
    import math

    from tasks.actor.actor import Actor, build_actor, ema_start, ema_step
    from tasks.actor.loop import update_rng
    from tasks.actor.optim import optimizer_step, split_critic
    t0 = time.perf_counter()
    batches = [b for bl in batch_lists for b in bl]

    def rebuild() -> Actor:
        actor = build_actor(cfg, batches[0]["obs"].shape[-1], batches[0]["actions"].shape[-1], load=False)
        actor.policy.load_state_dict(weights["state_dict"])
        actor.version = weights["version"]
        return actor

    actor, created = resident.get_or_create(f"{run_id}/actor", rebuild)
    if created:
        ema_start(cfg, actor)  # a lost average restarts from the weights the actor is rebuilt from
    policy, opt = actor.policy, actor.optimizer
    dev = next(policy.parameters()).device
    policy.train()
    table = instructions(cfg)  # a sample's prompt: the instruction table at its stored task_id
    losses, norms, vlosses = [], [], []
    skipped = 0
    with update_rng(cfg, int(weights["version"]), 0, dev):  # the loss's draws: a function of (seed, version)
        for b in batches:
            obs = policy_obs(policy, b["obs"], b["rgb"] if "rgb" in b and cfg.env.obs_mode == "rgb" else None,
                             table, b["task_id"])
            obs, actions = to_device(obs, dev), torch.from_numpy(b["actions"]).to(dev)
            if "returns" in b:  # value warm start: BC on the selected samples, value regression on all
                bc = torch.from_numpy(b["bc"]).to(dev)
                with autocast(cfg.policy.dtype, dev):
                    loss = policy.sft_loss({k: v[bc] for k, v in obs.items()}, actions[bc]) \
                        if bc.any() and cfg.sft.bc_coef > 0 else torch.zeros((), device=dev)
                    values = policy.values(obs).reshape(-1).float()
                vloss = ((values - torch.from_numpy(b["returns"]).to(dev)) ** 2).mean()
                terms = (float(loss.detach()), float(vloss.detach()))
                loss = cfg.sft.bc_coef * loss + cfg.sft.value_coef * vloss
            else:
                with autocast(cfg.policy.dtype, dev):
                    loss = policy.sft_loss(obs, actions)
                terms = (float(loss.detach()), None)
                loss = cfg.sft.bc_coef * loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            # the value head is clipped on its own: its loss must not shrink the BC step
            groups = list(split_critic(policy)) if "returns" in b else [list(policy.parameters())]
            applied, (norm, *_) = optimizer_step(opt, groups, cfg.algorithm.max_grad_norm,
                                                 loss_finite=math.isfinite(float(loss.detach())))
            if not applied:  # a non-finite loss or gradient: never applied
                skipped += 1
                continue
            losses.append(terms[0])
            norms.append(norm)
            if terms[1] is not None:
                vlosses.append(terms[1])
    policy.eval()
    ema_step(actor, cfg.algorithm.ema_decay)  # once per SFT step (algorithm.ema_decay), as after an RL update
    actor.version = weights["version"] + 1
    out = actor.weights()
    mean = (lambda xs: float(np.mean(xs)) if xs else math.nan)
    out["metrics"] = {"train/sft_loss": mean(losses), "train/grad_norm": mean(norms),
                      "train/minibatch_updates": float(len(batches) - skipped),
                      "train/skipped_updates": float(skipped), "train/weight_version": float(actor.version),
                      "train/actor_rebuilt": float(created), "train/lr": opt.param_groups[0]["lr"],
                      "time/update": time.perf_counter() - t0}
    if vlosses or (skipped and "returns" in batches[0]):
        out["metrics"]["train/critic_loss"] = mean(vlosses)
    return out
