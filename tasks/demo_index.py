"""Which recorded samples SFT learns from, and the dataset statistics taken from them (no import of the update
code: `tasks.update.actor_init` and `tasks.distributed.initial_weights` call `set_demo_action_stats`, `tasks.demos`
loads the samples)."""
from __future__ import annotations

import numpy as np
import torch

from tasks.config import Config


def sft_index(store_path: str, only_success: bool) -> np.ndarray:
    """int64 [M, 3] rows (step, t, b) of the chunk steps to learn from: complete steps, at least one executed
    action, and (only_success) an episode whose success flag was set at some chunk step.

    Raises:
        ValueError: the store holds no such chunk step (names the store and the filter).
    """
    from storage.trajectories import TrajectoryStore
    st = TrajectoryStore.open(store_path)
    steps = np.asarray(st.complete_steps(), np.int64)
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


def set_demo_action_stats(cfg: Config, policy: torch.nn.Module) -> bool:
    """Dataset statistics for a policy that un-normalises its actions (the token VLA's q01 / q99,
    `set_action_stats`) trained from scratch by SFT (`algorithm.name=sft`, no `policy.model_path`): the 1st / 99th
    percentiles per action dimension of the executed actions (step_mask) of the behaviour-cloning samples of
    `sft.store` (`sft_index`), as OpenVLA computes its dataset statistics (`action_stats_from_data`). A loaded
    policy keeps its own statistics (they came with its checkpoint). Returns whether they were set.

    Raises:
        ValueError: no selectable chunk step in the store (`sft_index`).
    """
    if cfg.algorithm.name != "sft" or cfg.policy.model_path or not hasattr(policy, "set_action_stats"):
        return False
    from storage.trajectories import TrajectoryStore
    from tasks.policies.token_vla import action_stats_from_data
    rows = sft_index(cfg.sft.store, cfg.sft.only_success)
    st = TrajectoryStore.open(cfg.sft.store)
    idx = (rows[:, 0], rows[:, 1], rows[:, 2])
    actions, mask = st.read("actions")[idx], st.read("step_mask")[idx]  # [M, C, D], [M, C]
    policy.set_action_stats(*action_stats_from_data(actions[mask]))  # [K, D] executed actions
    return True
