"""The ManiSkill env family's config: the keys every simulator has (`tasks.config.schema.EnvConfig`) and
ManiSkill's own (`env.simulator=maniskill`; tasks/envs/maniskill/adapter.py). Its rules: tasks.envs.maniskill.checks.
"""
from __future__ import annotations

from dataclasses import dataclass

from tasks.config.registry import register_family
from tasks.config.schema import EnvConfig
from tasks.envs.maniskill import checks


@register_family("env", "maniskill", checks=checks.CHECKS)
@dataclass(frozen=True)
class ManiSkillEnvConfig(EnvConfig):
    """A ManiSkill3 env task (`env_id`, e.g. PushCube-v1) on its CPU or GPU simulation."""

    simulator: str = "maniskill"
    # the fraction of the robot's visual-mesh faces the cameras render (tasks.envs.maniskill.mesh_lod: on a CPU a
    # capture's cost is the arm's ~136k triangles, not the pixels); collision meshes untouched: the same dynamics
    robot_visual_lod: float = 1.0
    # CPU envs: set the joint-position controller's drive targets directly and compute the env task's observation,
    # success and reward from the simulator's poses read once per step (tasks.envs.maniskill.fast_step:
    # bit-identical to ManiSkill's step, faster per env step); what it does not
    # cover stays ManiSkill's. False: always ManiSkill's step
    fast_step: bool = True
    inert_keys = staticmethod(checks.inert_keys)  # value-dependent keys that do nothing (tasks.config.checks.inert)
