"""The goal of a LIBERO pick-and-place task: what the scripted expert (tasks.envs.libero.expert) and
`env.object_state` read (one `in`/`on` BDDL predicate of a movable object)."""
from __future__ import annotations

import numpy as np

from tasks.envs.libero.suites import _import_libero, bddl_path, task_ids


def _pick_place_goal(goal: list, movable) -> bool:
    """A BDDL goal_state that is one `in`/`on` predicate whose first argument is in `movable` (object names)."""
    return len(goal) == 1 and len(goal[0]) == 3 and goal[0][0].lower() in ("in", "on") and goal[0][1] in movable


def goal_of(env) -> tuple[str, str, str]:
    """(predicate, object, target) of a LIBERO problem env's one-predicate goal.

    Raises ValueError when the goal is not a single `in`/`on` of a movable object (the scripted expert and
    env.object_state do not apply)."""
    goal = env.parsed_problem["goal_state"]
    if not _pick_place_goal(goal, env.objects_dict):
        raise ValueError(f"the scripted expert and env.object_state handle one 'in'/'on' goal of a movable object, "
                         f"this task's goal is {goal}")
    pred, obj, target = goal[0]
    return pred.lower(), obj, target


def object_position(env, name: str) -> np.ndarray:
    """World position (m), float64 [3], of a LIBERO object body or region site `name` (e.g. `akita_black_bowl_1`,
    `basket_1_contain_region`) in the problem env `env`, from MuJoCo's current state."""
    if name in env.obj_body_id:
        return np.array(env.sim.data.body_xpos[env.obj_body_id[name]])
    return np.array(env.sim.data.get_site_xpos(name))  # a region site


def tasks_without_pick_place_goal(cfg) -> list[int]:
    """Offline: the selected tasks of cfg's suite (env.task_ids) whose goal, read from their BDDL files, is not one
    `in`/`on` predicate of a movable object (what the expert and `env.object_state` handle)."""
    _import_libero()
    from libero.libero.envs.bddl_utils import robosuite_parse_problem
    bad = []
    for t in task_ids(cfg):
        prob = robosuite_parse_problem(bddl_path(cfg.env_id, t))
        if not _pick_place_goal(prob["goal_state"], {n for names in prob["objects"].values() for n in names}):
            bad.append(t)
    return bad

