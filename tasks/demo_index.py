"""Which recorded samples SFT learns from, and the dataset statistics taken from them (no import of the update
code: `tasks.actor.entries.actor_init` and `tasks.actor.distributed.initial_weights` call `set_demo_stats`, `tasks.demos`
loads the samples)."""
from __future__ import annotations

import numpy as np
import torch

from storage.trajectories import DamagedStore  # the one class of a damaged store (re-exported here)
from tasks.config import Config


def sft_index(store_path: str, only_success: bool) -> np.ndarray:
    """int64 [M, 3] rows (step, t, b) of the chunk steps to learn from: complete steps, at least one executed
    action, and (only_success) an episode whose success flag was set at some chunk step.

    Raises:
        DamagedStore: missing data: a recording whose index lists episodes but no complete step, or a chunk file of
            a complete step missing or undecodable or an array's metadata unreadable (the store's verified read,
            `TrajectoryStore.read`: zarr would read a missing chunk as the fill value, all-False).
        ValueError: the store holds no such chunk step (names the store and the filter).
    """
    from storage.trajectories import TrajectoryStore
    st = TrajectoryStore.open(store_path)
    steps = np.asarray(st.complete_steps(), np.int64)
    if not len(steps) and int(st.attrs.get("episodes", 0) or 0) > 0:
        raise DamagedStore(f"trajectory store {store_path} is damaged: its index lists {st.attrs['episodes']} "
                           f"episodes but no step is marked complete (steps/complete chunk files missing?); "
                           f"re-record it, or restore it from a whole copy")
    mask = st.read("step_mask", steps).any(-1)  # [N, T, B]
    ep_id = st.read("episode_id", steps)
    if only_success:
        succ = st.read("success", steps)
        good = np.unique(ep_id[succ & mask])
        mask &= np.isin(ep_id, good)
    rows = np.argwhere(mask)
    if not len(rows):
        raise ValueError(f"sft.store={store_path}: no chunk step to learn from"
                         f"{' in a successful episode (sft.only_success=true)' if only_success else ''}")
    rows[:, 0] = steps[rows[:, 0]]
    return rows.astype(np.int64)


SFT_FIELDS = ("obs", "rgb", "actions", "task_id")  # what an SFT data worker holds per sample (those stored)
VALUE_FIELDS = ("rewards", "step_mask", "truncated")  # what the value warm start reads (`sft.value_coef` > 0)


def sft_fields(stored, only_success: bool, value: bool) -> tuple[str, ...]:
    """Every field an SFT run reads from its store, of those `stored` (a store's field names): `sft_index`'s
    (step_mask, episode_id, and success with `only_success`), the samples' `SFT_FIELDS` and, with `value`
    (`sft.value_coef` > 0), the value warm start's `VALUE_FIELDS`. The fields whose chunk files `pipelines.config`
    checks before a run starts."""
    index = ("step_mask", "episode_id", *(("success",) if only_success else ()))
    wanted = (*index, *SFT_FIELDS, *(VALUE_FIELDS if value else ()))
    return tuple(dict.fromkeys(f for f in wanted if f in stored))


SFT_WORKER_BASE_GIB = 1.0  # an SFT env worker without its samples: ManiSkill eval shard, torch (measured 2026-12-05:
# 0.98-1.01 GiB peak RSS in 3 PushCube VLA SFT runs whose samples were 6 MB)


def sft_dataset_bytes(store_path: str, rows: int) -> int:
    """Peak bytes the samples of `rows` chunk steps of `store_path` take in an SFT data worker
    (`tasks.demos._dataset`, cached per worker): per sample the stored `SFT_FIELDS` plus the value pass's `bc` and
    `returns` (5 bytes), and, while loading, one training step's whole field (it is read one step at a time).
    Estimated from the store's layout, nothing read."""
    from storage.trajectories import TrajectoryStore
    st = TrajectoryStore.open(store_path)
    per = [int(np.prod(f.shape, dtype=np.int64)) * np.dtype(f.dtype).itemsize
           for k, f in st.fields.items() if k in SFT_FIELDS]
    return rows * (sum(per) + 5) + st.T * st.num_envs * max(per, default=0)


STATE_STD_FLOOR = 0.01  # units of the state (m, rad): a near-constant dimension is scaled by at most 100
ACTION_STD_FLOOR = 0.01  # action units: the same bound for policy.normalize_actions


def set_demo_stats(cfg: Config, policy: torch.nn.Module) -> bool:
    """Dataset statistics of a policy trained from scratch by SFT (`algorithm.name=sft`, no `policy.model_path`),
    from the behaviour-cloning samples of `sft.store` (`sft_index`):
    - a policy that un-normalises its actions (the token VLA's q01 / q99, `set_action_stats`): the 1st / 99th
      percentiles per action dimension of the executed actions (step_mask), as OpenVLA computes its dataset
      statistics (`action_stats_from_data`);
    - with `policy.normalize_state` a VLA's state standardisation (`PrefixEncoder.set_state_stats`): the mean and
      the std (floored at STATE_STD_FLOOR) per dimension of the samples' state vectors;
    - with `policy.normalize_actions` a flow VLA's action standardisation (`set_action_norm`): the mean and the std
      (floored at ACTION_STD_FLOOR) per dimension of the executed actions.
    A loaded policy keeps its own statistics (they came with its checkpoint). Returns whether any were set.

    Raises:
        ValueError: no selectable chunk step in the store (`sft_index`).
        DamagedStore: a chunk file it reads missing or undecodable (`TrajectoryStore.gather`).
    """
    if cfg.algorithm.spec.rollout or cfg.policy.model_path:  # statistics from sft.store: SFT only (no rollout)
        return False
    p = cfg.policy  # a family without the keys (the mlp) normalises nothing
    state = (getattr(p, "normalize_state", False)
             and getattr(getattr(policy, "prefix", None), "state_proj", None) is not None)
    norm = getattr(p, "normalize_actions", False) and hasattr(policy, "set_action_norm")
    if not (hasattr(policy, "set_action_stats") or state or norm):
        return False
    from storage.trajectories import TrajectoryStore
    rows = sft_index(cfg.sft.store, cfg.sft.only_success)
    st = TrajectoryStore.open(cfg.sft.store)
    if hasattr(policy, "set_action_stats") or norm:
        actions, mask = st.gather("actions", rows), st.gather("step_mask", rows)  # [M, C, D], [M, C]
        executed = actions[mask]  # [K, D] the executed actions of the samples
        if hasattr(policy, "set_action_stats"):
            from tasks.policies.token_vla.model import action_stats_from_data
            policy.set_action_stats(*action_stats_from_data(executed))
        if norm:  # policy.normalize_actions
            x = executed.astype(np.float64)
            policy.set_action_norm(x.mean(0), np.maximum(x.std(0), ACTION_STD_FLOOR))
    if state:  # policy.normalize_state: the samples' state at their chunk start, [M, O]
        obs = st.gather("obs", rows).astype(np.float64)
        policy.prefix.set_state_stats(obs.mean(0), np.maximum(obs.std(0), STATE_STD_FLOOR))
    return True
