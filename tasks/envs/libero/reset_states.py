"""LIBERO's reset states: the global `reset_state_id` of every (task, trial) pair, the train / eval split of each
task's init states, and the reset state a shard's reset seed selects (tasks.envs.libero.adapter, "Reset states").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tasks.config import ConfigError
from tasks.envs.libero.suites import task_ids, trial_counts

if TYPE_CHECKING:
    from tasks.config import EnvConfig


@dataclass(frozen=True)
class ResetStates:
    """The global `reset_state_id` of every (task_id, trial_id) pair: task t's trials are ids
    offset[t] .. offset[t] + trial_counts[t] - 1, offset[t] = sum(trial_counts[:t]).

    Args:
        trial_counts: init states per task, in the suite's task order (50 each in LIBERO's suites).
    """

    trial_counts: tuple[int, ...]

    def __post_init__(self):
        if not self.trial_counts or min(self.trial_counts) < 1:
            raise ValueError(f"every task needs >= 1 init state, got trial counts {list(self.trial_counts)}")

    @property
    def offsets(self) -> np.ndarray:
        """int64 [tasks + 1]: the first id of each task, then the total."""
        return np.concatenate([[0], np.cumsum(self.trial_counts)]).astype(np.int64)

    @property
    def num_states(self) -> int:
        return int(sum(self.trial_counts))

    def reset_state_id(self, task_id: int, trial_id: int) -> int:
        """The global id of (task_id, trial_id). Raises ValueError when either is out of range."""
        if not 0 <= task_id < len(self.trial_counts) or not 0 <= trial_id < self.trial_counts[task_id]:
            raise ValueError(f"(task_id={task_id}, trial_id={trial_id}) is not a reset state of tasks with "
                             f"{list(self.trial_counts)} trials")
        return int(self.offsets[task_id] + trial_id)

    def task_trial(self, reset_state_id: int) -> tuple[int, int]:
        """(task_id, trial_id) of a global id (the inverse of `reset_state_id`). Raises ValueError out of range."""
        if not 0 <= reset_state_id < self.num_states:
            raise ValueError(f"reset_state_id={reset_state_id} is outside 0..{self.num_states - 1}")
        t = int(np.searchsorted(self.offsets, reset_state_id, side="right") - 1)
        return t, int(reset_state_id - self.offsets[t])


def split_trials(num: int, split: str, eval_trials: int, num_trials: int | None = None) -> dict[str, list[int]]:
    """The trial ids of one task's train and eval splits: {"train": [...], "eval": [...]}.

    `disjoint`: eval = the last `eval_trials` of range(num), train = the others; `shared`: both range(num).
    `num_trials` keeps the first that many of each split (None: all). Raises ConfigError when a split is empty.
    """
    if split == "shared":
        out = {"train": list(range(num)), "eval": list(range(num))}
    else:
        if not 0 < eval_trials < num:
            raise ConfigError("env.eval_trials", eval_trials, f"must be 1..{num - 1} for a task of {num} init "
                                                              f"states with env.trial_split=disjoint (or use shared)")
        out = {"train": list(range(num - eval_trials)), "eval": list(range(num - eval_trials, num))}
    if num_trials is not None:
        out = {k: v[:num_trials] for k, v in out.items()}
    return out


def reset_state_for_seed(seed: int, *, tasks: Sequence[int], counts: Sequence[int], base_seed: int, eval_seed: int,
                         split: str, eval_trials: int, num_trials: int | None = None) -> int:
    """The global reset_state_id a shard's reset seed selects (module docstring: train seeds below `eval_seed`,
    eval seeds from it; u = seed - base, task tasks[u % T], trial (u // T) % n of that task's split).

    Raises ValueError for a train seed below `base_seed`.
    """
    is_eval = seed >= eval_seed
    u = seed - (eval_seed if is_eval else base_seed)
    if u < 0:
        raise ValueError(f"reset seed {seed} is below env.seed={base_seed}")
    T = len(tasks)
    t = int(tasks[u % T])
    trials = split_trials(int(counts[t]), split, eval_trials, num_trials)["eval" if is_eval else "train"]
    return ResetStates(tuple(int(c) for c in counts)).reset_state_id(t, trials[(u // T) % len(trials)])



def protocol_episodes(cfg: EnvConfig) -> int:
    """Episodes of the evaluation protocol: every selected task x every init state of its eval split (with
    env.num_trials: the first that many); eval seed eval.seed + u, u < this count, visits each pair once."""
    counts = trial_counts(cfg.env_id)
    return sum(len(split_trials(counts[t], cfg.trial_split, cfg.eval_trials, cfg.num_trials)["eval"])
               for t in task_ids(cfg))

