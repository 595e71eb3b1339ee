"""The LIBERO env family's config: the keys every simulator has (`tasks.config.schema.EnvConfig`) and LIBERO's own
(`env.simulator=libero`, `env.env_id` = the suite; tasks/envs/libero/adapter.py). Its rules: tasks.envs.libero.checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tasks.config.registry import register_family
from tasks.config.schema import EnvConfig
from tasks.envs.libero import checks


@register_family("env", "libero", checks=checks.CHECKS)
@dataclass(frozen=True)
class LiberoEnvConfig(EnvConfig):
    """A LIBERO suite (`env_id`: libero_spatial, libero_object, libero_goal, libero_10, libero_90) and which of its
    tasks and init states the run uses."""

    simulator: str = "libero"
    task_ids: list[int] = field(default_factory=list)  # the suite's tasks to use; empty: all
    num_trials: Optional[int] = None  # the first N init states of each task's split; None: all
    num_steps_wait: int = 10  # no-op steps after each reset (objects settle); not counted, not trained on
    trial_split: str = "disjoint"  # disjoint: each task's last eval_trials init states are eval-only; shared: both
    eval_trials: int = 10  # init states per task reserved for evaluation with trial_split=disjoint
    # a privileged state: the 8-D proprio state + the goal object's position relative to the end-effector and the
    # goal target's relative to the object (m, from the simulator's poses; 14-D), as ManiSkill's state obs hold
    # the object poses. False: the community's 8-D proprio state only (objects seen through the camera alone)
    object_state: bool = False
    # the prompt of each task: benchmark = LIBERO's task.language (what openpi's and OpenVLA's LIBERO evaluations
    # and their published checkpoints use); bddl = the `(:language ...)` line of the task's BDDL file (differs
    # for 29 of the 130 tasks: "pick the akita black bowl ..." for "pick up the black bowl ...")
    instruction_source: str = "benchmark"
    # a second camera: robosuite's `robot0_eye_in_hand` (the wrist camera LIBERO's demonstrations and openpi's /
    # RLinf's pi0 LIBERO checkpoints see), rendered like the agentview (env.image_size, rotated 180 degrees); the
    # observation's images then hold both cameras (tasks.envs.libero.adapter), the policy sees "rgb" and
    # "wrist_rgb". Needs obs_mode=rgb and a policy family that reads two cameras (its config's `cameras` >= 2)
    wrist_camera: bool = False
