"""A scripted pick-and-place expert for LIBERO, driven by the simulator's object poses (no learning, no images).

It reads the task's BDDL goal (`parsed_problem["goal_state"]`, e.g. `[["in", "alphabet_soup_1",
"basket_1_contain_region"]]` or `[["on", "akita_black_bowl_1", "plate_1"]]`), so it applies to every task whose goal
is ONE `in`/`on` predicate of a movable object (LIBERO-Object: all 10 tasks; LIBERO-Spatial: all 10, "pick up the
black bowl ... and place it on the plate"). Each step it computes, from MuJoCo's current state (object body
position `sim.data.body_xpos`, region site position `sim.data.get_site_xpos`, end-effector site position), a 7-D
OSC_POSE action in [-1, 1] (tasks.envs.libero.adapter: +1 closes the gripper) through these phases:

    above  (object xy, hover height, open)  -> descend (grasp height, open) -> close (hold, +1 until the fingers
    stop) -> lift (carry height, closed) -> carry (target xy, carry height) -> lower (release height) -> open (hold,
    -1 until the fingers stop) -> retreat (up, open; held until the episode ends)

A moving phase ends when the end-effector is within `tol` of its waypoint (or after its step budget); `close` and
`open` end when the finger gap (robosuite's `gripper_qpos`, in the policy's 8-D state) changed by less than
`FINGER_STILL` m over the last step (at least 2 steps, at most CLOSE_STEPS / OPEN_STEPS). Every phase change is
therefore a function of what a clone observes (positions, finger gap), not of a hidden step count (a fixed-length
hold makes "keep holding" and "move on now" one observation once the fingers have stopped). For libero_spatial's
bowls the fingers stop after 10-11 steps, so there the recording equals the old fixed 12-step hold's (measured:
the identical store; README "Measured recipe on LIBERO"). Position actions are
a P-controller on the waypoint: robosuite 1.4's OSC_POSE scales an action a in [-1, 1] to a delta of
a * output_max (0.05 m for position, 0.5 rad for rotation, read from the controller) applied to the current
end-effector pose, so a = gain * (waypoint - eef) / 0.05, clipped to +-`max_action`. Orientation: a P-controller that
holds the end-effector's orientation at the episode's first step (the top-down grasp of the init states).

The grasp point is the object's body origin with the height offset of its kind (GRASP_OFFSETS: bowls are grasped
at the rim, off-centre along the fingers' closing axis; other objects at their body origin). Success is never
judged here: callers use LIBERO's own `check_success()` (tasks.envs.libero.adapter: the reward).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tasks.envs.libero.goals import goal_of, object_position, tasks_without_pick_place_goal

PHASES = ("above", "descend", "close", "lift", "carry", "lower", "open", "retreat")
CLOSE_STEPS, OPEN_STEPS = 12, 8  # step budgets of the gripper phases (a bowl's rim: the fingers stop after 10-11)
FINGER_STILL = 2e-4  # m: a finger gap change per step below this ends `close` / `open`


@dataclass
class ExpertParams:
    """Waypoint heights (m, world frame, relative to the object/target origin unless said) and controller gains."""

    hover: float = 0.10  # above the object's origin before descending
    grasp_dz: float = 0.0  # grasp height relative to the object's origin (overridden per kind, GRASP_OFFSETS)
    carry_dz: float = 0.20  # carry height above the object's origin at the grasp (m): clears the basket's rim
    release_dz: float = 0.10  # release height of the grasp point above the target origin
    tol: float = 0.01  # waypoint reached (m)
    gain: float = 1.0
    max_action: float = 1.0
    rot_gain: float = 1.0
    phase_steps: int = 80  # step budget of a moving phase


# object-name prefix -> (dz, dx along the fingers' closing axis) of the grasp point from the body origin (m)
GRASP_OFFSETS = {"akita_black_bowl": (0.03, 0.047)}


def _kind(name: str) -> str:
    """'akita_black_bowl_1' -> 'akita_black_bowl'."""
    head, _, tail = name.rpartition("_")
    return head if tail.isdigit() else name


@dataclass
class PickPlaceExpert:
    """Closed-loop scripted expert of one episode: call `reset(env)` after each env reset, then `act(env)` each
    step. `env` is the LIBERO problem env (robosuite `SingleArmEnv`), e.g. `LiberoEnv.env.env`.

    `act` returns float32 [7] in [-1, 1]; `phase` names the current phase (PHASES)."""

    params: ExpertParams = field(default_factory=ExpertParams)

    def reset(self, env) -> None:
        self.pred, self.obj, self.target = goal_of(env)
        robot = env.robots[0]
        self._site = robot.eef_site_id
        c = robot.controller
        self._scale = np.asarray(c.output_max, np.float64)  # [6]: metres and radians per unit action
        self._rot0 = np.array(env.sim.data.site_xmat[self._site]).reshape(3, 3)
        self.phase, self._count = PHASES[0], 0
        self._grasp_off = None
        self._fingers = robot._ref_gripper_joint_pos_indexes  # qpos addresses of the two finger joints
        self._gap = self._finger_gap(env)
        self._carry_z = object_position(env, self.obj)[2] + self.params.carry_dz

    # ----- geometry -----
    def _eef(self, env) -> np.ndarray:
        return np.array(env.sim.data.site_xpos[self._site])

    def _finger_gap(self, env) -> float:
        q = env.sim.data.qpos[self._fingers]
        return float(q[0] - q[1])  # the Panda's fingers move in opposite directions

    def _fingers_still(self, env) -> bool:
        """The finger gap changed by less than FINGER_STILL since the previous call (updates the stored gap)."""
        gap = self._finger_gap(env)
        still = abs(gap - self._gap) < FINGER_STILL
        self._gap = gap
        return still

    def _grasp_point(self, env) -> np.ndarray:
        dz, dx = GRASP_OFFSETS.get(_kind(self.obj), (self.params.grasp_dz, 0.0))
        # the fingers close along the end-effector site's x axis (measured: the Panda's finger bodies lie apart along
        # it): a rim grasp sits off the centre along that axis, so the rim wall lies between the fingers
        axis = self._rot0[:, 0].copy()
        axis[2] = 0.0
        axis /= max(np.linalg.norm(axis), 1e-9)
        return object_position(env, self.obj) + np.array([0.0, 0.0, dz]) + dx * axis

    # ----- control -----
    def _action(self, env, waypoint: np.ndarray, grip: float) -> np.ndarray:
        p = self.params
        a = np.zeros(7)
        a[:3] = np.clip(p.gain * (waypoint - self._eef(env)) / self._scale[:3], -p.max_action, p.max_action)
        rot = np.array(env.sim.data.site_xmat[self._site]).reshape(3, 3)
        err = self._rot0 @ rot.T  # rotation taking the current orientation to the initial one (world frame)
        from robosuite.utils.transform_utils import mat2quat, quat2axisangle
        a[3:6] = np.clip(p.rot_gain * quat2axisangle(mat2quat(err)) / self._scale[3:], -1, 1)
        a[6] = grip
        return a.astype(np.float32)

    def _advance(self, reached: bool, budget: int) -> None:
        self._count += 1
        if reached or self._count >= budget:
            self.phase = PHASES[min(PHASES.index(self.phase) + 1, len(PHASES) - 1)]
            self._count = 0

    def act(self, env) -> np.ndarray:
        """The action for the env's current state (float32 [7]); advances the phase machine."""
        p = self.params
        eef = self._eef(env)
        still = self._fingers_still(env)  # the gripper's motion over the last step
        ph = self.phase
        if ph in ("above", "descend"):
            g = self._grasp_point(env)
            wp = g + np.array([0, 0, p.hover]) if ph == "above" else g
            tol = p.tol if ph == "descend" else 2 * p.tol
            a = self._action(env, wp, -1.0)
            self._advance(np.linalg.norm(wp - eef) < tol, p.phase_steps)
            if self.phase == "close":
                self._hold = eef
            return a
        if ph == "close":
            a = self._action(env, self._hold, 1.0)
            self._advance(self._count >= 2 and still, CLOSE_STEPS)
            if self.phase == "lift":
                o = object_position(env, self.obj)
                self._grasp_off = eef - o
                self._carry_z = o[2] + p.carry_dz
            return a
        tgt = object_position(env, self.target)
        if ph == "lift":
            wp = np.array([eef[0], eef[1], self._carry_z]) if self._count == 0 else self._lift_wp
            self._lift_wp = wp
            a = self._action(env, wp, 1.0)
            self._advance(abs(wp[2] - eef[2]) < 2 * p.tol, p.phase_steps)
            return a
        # the object's origin should end above the target's: aim the end-effector with the grasp offset
        off = self._grasp_off if self._grasp_off is not None else np.zeros(3)
        if ph == "carry":
            wp = np.array([tgt[0] + off[0], tgt[1] + off[1], self._carry_z])
            a = self._action(env, wp, 1.0)
            self._advance(np.linalg.norm(wp[:2] - eef[:2]) < p.tol, p.phase_steps)
            return a
        if ph == "lower":
            wp = np.array([tgt[0] + off[0], tgt[1] + off[1], tgt[2] + off[2] + p.release_dz])
            a = self._action(env, wp, 1.0)
            self._advance(np.linalg.norm(wp - eef) < p.tol, p.phase_steps)
            if self.phase == "open":
                self._hold = eef
            return a
        if ph == "open":
            a = self._action(env, self._hold, -1.0)
            self._advance(self._count >= 2 and still, OPEN_STEPS)
            return a
        wp = np.array([eef[0], eef[1], self._carry_z])  # retreat
        return self._action(env, wp, -1.0)


def expert_episode(env, task_id: int, trial_id: int, params: ExpertParams | None = None) -> dict:
    """Run one expert episode on a `tasks.envs.libero.adapter.LiberoEnv` from init state (task_id, trial_id) until LIBERO's
    success check holds (the env's `terminated`) or the episode's step limit.

    Returns {"actions": float32 [L, 7] (the executed actions), "success": bool (LIBERO's check at the last step),
    "steps": L, "phase": the expert's last phase}."""
    env.reset_to(task_id, trial_id)
    ex = PickPlaceExpert(params or ExpertParams())
    sim_env = problem_env(env)
    ex.reset(sim_env)
    actions, success = [], False
    for _ in range(env.max_steps):
        a = ex.act(sim_env)
        actions.append(a)
        _, _, success, truncated, _ = env.step(a)
        if success or truncated:
            break
    return {"actions": np.stack(actions), "success": bool(success), "steps": len(actions), "phase": ex.phase}


def problem_env(env):
    """The LIBERO problem env (robosuite `SingleArmEnv` with `parsed_problem`, `obj_body_id`, `sim`) inside a
    `tasks.envs.libero.adapter.LiberoEnv` (its OffScreenRenderEnv's `env`); None before the first reset built it."""
    return None if env.env is None else env.env.env


def check_tasks(cfg) -> None:
    """Offline: every selected task of cfg's suite has a goal the expert handles (one `in`/`on` predicate whose
    first argument is a movable object), read from its BDDL file. Raises ConfigError (env.task_ids)."""
    from tasks.config import ConfigError
    import tasks.envs.libero.adapter as L
    L.check_config(cfg)
    bad = tasks_without_pick_place_goal(cfg)
    if bad:
        raise ConfigError("env.task_ids", list(L.task_ids(cfg)),
                          f"the scripted expert picks one object and places it in/on a target; task(s) {bad} of "
                          f"{cfg.env_id} have another goal: select pick-and-place tasks (libero_object, "
                          f"libero_spatial: all)")


class ShardExpert:
    """The scripted teacher of a `tasks.envs.EnvShard` of `LiberoEnv`s (`record.teacher=scripted:libero`): one
    `PickPlaceExpert` per env, reset whenever that env starts a new episode.

    `act(shard)` -> float32 [B, 1, 7]: each active env's action for its current state; zeros for idle envs.

    `action_noise` (record.action_noise): std of Gaussian noise added to the 6 motion dims of every action (then
    clipped to [-1, 1]), from a generator seeded by the episode's reset seed (a recording is reproducible); the
    expert's P-controllers correct it at the next step. The gripper dim is never perturbed."""

    def __init__(self, shard, params: ExpertParams | None = None, action_noise: float = 0.0):
        self.params = params or ExpertParams()
        self.action_noise = float(action_noise)
        self.experts = [PickPlaceExpert(self.params) for _ in range(shard.num_envs)]
        self.episode = [-1] * shard.num_envs
        self.rngs: list[np.random.Generator | None] = [None] * shard.num_envs

    def act(self, shard) -> np.ndarray:
        seeds, ids = shard.current_episodes()
        out = np.zeros((shard.num_envs, 1, shard.action_dim), np.float32)
        for b, (ex, env) in enumerate(zip(self.experts, shard.envs)):
            if ids[b] < 0:
                continue
            sim_env = problem_env(env)
            if ids[b] != self.episode[b]:
                ex.reset(sim_env)
                self.episode[b] = int(ids[b])
                self.rngs[b] = np.random.default_rng(int(seeds[b]))
            a = ex.act(sim_env)
            if self.action_noise:
                a[:6] = np.clip(a[:6] + self.rngs[b].normal(0.0, self.action_noise, 6), -1.0, 1.0)
            out[b, 0] = a
        return out
