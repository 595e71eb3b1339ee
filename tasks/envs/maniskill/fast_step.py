"""ManiSkill's step for one CPU env without its per-step tensor bookkeeping (`env.fast_step`, on by default): the
same physics sub-steps and control hooks (ManiSkill's `_step_action`), with the controller's drive targets set
directly and the env task's observation, success and reward computed from the simulator's poses read once.

Why: on a CPU env (`physx_cpu`, one env per instance) ManiSkill builds a batch-1 torch `Pose` for every pose it
reads, and PushCube-v1 reads the cube's pose nine times per step (success, observation, dense reward). Profiled on
this machine (1 600 steps of one PushCube env): `env.step` 1.67 s, of which physics 0.41 s, the controller 0.38 s,
the reward 0.41 s, the success check 0.20 s and the observation 0.14 s; the pose reads are ~0.33 s of it.

The fast step reproduces ManiSkill 3's `BaseEnv.step` + its `TimeLimitWrapper` BIT FOR BIT: the drive targets are
the controller's float32 arithmetic, the observation is the same float32 values in the same order
(`flatten_state_dict` of agent qpos, qvel and the task's extra state), success and reward use the same torch ops on
tensors of the same shapes and layouts as the env task's `evaluate` / `compute_dense_reward` (so float32 rounding
is the same), `terminated` = success, `truncated` = elapsed steps >= the time limit.
tests/tasks/envs/test_maniskill_fast.py checks it against ManiSkill's step, value for value, over episodes that
include success and every branch of the rewards.

Reset stays ManiSkill's (`env.reset`), as does whatever is not covered here: another controller, another env
task's observation and reward, other reward modes (`fast_step_for`).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

# (obs float32 [O], reward, terminated, truncated, success) of one step, action float32 [D] in [-1, 1]
FastStep = Callable[[np.ndarray], tuple]


def _time_limit(env) -> Optional[int]:
    """The ManiSkill TimeLimitWrapper's limit in the wrapper chain of `env` (None: no limit)."""
    while env is not None and hasattr(env, "env"):
        if type(env).__name__ == "TimeLimitWrapper":
            return env._max_episode_steps
        env = env.env
    return None


def _raw(pose):
    """`Pose.create([sapien.Pose]).raw_pose`: float32 [1, 7] (p, q) of a sapien pose, as ManiSkill builds it."""
    import torch
    return torch.from_numpy(np.concatenate([pose.p, pose.q])[None])


def _push_cube(base) -> Callable[[], tuple[np.ndarray, float, bool]]:
    """PushCube-v1 (ManiSkill 3.0): observation, reward and success of the current state, as
    `PushCubeEnv.evaluate`, `_get_obs_extra` (state) and `compute_dense_reward` / `compute_normalized_dense_reward`
    compute them (max reward 4; success: cube xy within goal_radius of the goal's and cube z < half size + 5 mm;
    reward: 1 - tanh(5 d) for the TCP's distance d to the push pose 2.5 cm behind the cube, plus
    (1 - tanh(5 d_goal)) * (1 + (1 - tanh(5 |z - half|))) once d < 1 cm, 4 on success)."""
    import torch
    obj, goal = base.obj._objs[0], base.goal_region._objs[0]
    tcp, robot = base.agent.tcp._objs[0], base.agent.robot._objs[0]
    half, radius = base.cube_half_size, base.goal_radius
    push_offset = torch.tensor([-half - 0.005, 0, 0])
    scale = 4.0 if base._reward_mode == "normalized_dense" else 1.0  # else "dense" (fast_step_for checks)

    def compute():
        qpos, qvel = robot.qpos, robot.qvel
        obj_raw, goal_raw, tcp_raw = _raw(obj.pose), _raw(goal.pose), _raw(tcp.entity_pose)
        obj_p, goal_p, tcp_p = obj_raw[..., :3], goal_raw[..., :3], tcp_raw[..., :3]
        success = (torch.linalg.norm(obj_p[..., :2] - goal_p[..., :2], axis=1) < radius) \
            & (obj_p[..., 2] < half + 5e-3)
        obs = np.concatenate([qpos, qvel, tcp_raw[0].numpy(), goal_raw[0, :3].numpy(), obj_raw[0].numpy()])
        tcp_to_push_dist = torch.linalg.norm(obj_p + push_offset - tcp_p, axis=1)
        reward = 1 - torch.tanh(5 * tcp_to_push_dist)
        reached = tcp_to_push_dist < 0.01
        obj_to_goal_dist = torch.linalg.norm(obj_p[..., :2] - goal_p[..., :2], axis=1)
        place_reward = 1 - torch.tanh(5 * obj_to_goal_dist)
        reward += place_reward * reached
        z_reward = 1 - torch.tanh(5 * torch.abs(obj_p[..., 2] - half))
        reward += place_reward * z_reward * reached
        reward[success] = 4
        return obs, float(reward[0] / scale), bool(success[0])

    return compute


def _pick_cube(base) -> Callable[[], tuple[np.ndarray, float, bool]]:
    """PickCube-v1 (ManiSkill 3.0), as `PickCubeEnv.evaluate`, `_get_obs_extra` (state) and `compute_dense_reward`
    compute them (max reward 5; success: cube within goal_thresh of the goal and the arm static, max |qvel| of the
    arm joints <= 0.2; reward: 1 - tanh(5 d_tcp,cube) + grasped (1 + 1 - tanh(5 d_cube,goal)) + placed
    (1 - tanh(5 |qvel_arm|)), 5 on success). The grasp check is ManiSkill's own `agent.is_grasping` (contact
    impulses between the fingers and the cube)."""
    import torch
    cube, goal = base.cube._objs[0], base.goal_site._objs[0]
    tcp, robot = base.agent.tcp._objs[0], base.agent.robot._objs[0]
    thresh = base.goal_thresh
    scale = 5.0 if base._reward_mode == "normalized_dense" else 1.0

    def compute():
        qpos, qvel = robot.qpos, robot.qvel
        cube_raw, goal_raw, tcp_raw = _raw(cube.pose), _raw(goal.pose), _raw(tcp.entity_pose)
        cube_p, goal_p, tcp_p = cube_raw[..., :3], goal_raw[..., :3], tcp_raw[..., :3]
        is_obj_placed = torch.linalg.norm(goal_p - cube_p, axis=1) <= thresh
        is_grasped = base.agent.is_grasping(base.cube)
        arm_qvel = torch.from_numpy(qvel[None])[..., :-2]
        is_robot_static = torch.max(torch.abs(arm_qvel), 1)[0] <= 0.2
        success = is_obj_placed & is_robot_static
        obs = np.concatenate([qpos, qvel, is_grasped.numpy().astype(np.float32), tcp_raw[0].numpy(),
                              goal_raw[0, :3].numpy(), cube_raw[0].numpy(), (cube_p - tcp_p)[0].numpy(),
                              (goal_p - cube_p)[0].numpy()])
        reward = 1 - torch.tanh(5 * torch.linalg.norm(cube_p - tcp_p, axis=1))
        reward += is_grasped
        place_reward = 1 - torch.tanh(5 * torch.linalg.norm(goal_p - cube_p, axis=1))
        reward += place_reward * is_grasped
        static_reward = 1 - torch.tanh(5 * torch.linalg.norm(arm_qvel, axis=1))
        reward += static_reward * is_obj_placed
        reward[success] = 5
        return obs, float(reward[0] / scale), bool(success[0])

    return compute


# env tasks whose observation, success and reward are computed here (state obs, dense rewards, the Panda)
_TASKS = {"PushCube-v1": _push_cube, "PickCube-v1": _pick_cube}


def _fast_controller(base) -> Optional[Callable[[np.ndarray], None]]:
    """`agent.set_action` for a CombinedController of joint-position parts with normalized actions and no
    interpolation (Panda's `pd_joint_delta_pos`: PDJointPosController with use_delta and not use_target, plus the
    gripper's absolute PDJointPosMimicController), or None for any other controller.

    The same float32 arithmetic as ManiSkill's (`clip_and_scale_action`: clip to [-1, 1], then
    0.5 (high + low) + 0.5 (high - low) a; delta targets = current qpos + that; mimic joints = control joint x
    multiplier + offset), one drive target per joint written straight to the joint, and the controllers' own
    `_start_qpos` / `_target_qpos` / `_step` updated as theirs would be."""
    import torch
    from mani_skill.agents.controllers.base_controller import CombinedController
    from mani_skill.agents.controllers.pd_joint_pos import PDJointPosController, PDJointPosMimicController
    controller, robot = base.agent.controller, base.agent.robot._objs[0]
    if type(controller) is not CombinedController:
        return None
    parts = []
    for uid, c in controller.controllers.items():
        mimic = type(c) is PDJointPosMimicController
        if (type(c) is not PDJointPosController and not mimic) or c.config.interpolate or not c._normalize_action \
                or c.config.use_target or (mimic and c.config.use_delta):
            return None
        start, end = controller.action_mapping[uid]
        low, high = c.action_space_low, c.action_space_high
        parts.append(dict(
            c=c, start=start, end=end, delta=bool(c.config.use_delta), mimic=mimic,
            mid=(0.5 * (high + low)).numpy(), half=(0.5 * (high - low)).numpy(),
            idx=c.active_joint_indices.numpy(), joints=[j._objs[0] for j in c.joints],
            control=c.control_joint_indices.numpy() if mimic else None,
            mimic_idx=c.mimic_joint_indices.numpy() if mimic else None,
            mimic_src=c.mimic_control_joint_indices.numpy() if mimic else None,
            mult=c._multiplier.numpy() if mimic else None, offset=c._offset.numpy() if mimic else None))

    def set_action(action: np.ndarray) -> None:
        if np.isnan(action).any():
            raise ValueError(f"Action cannot be NaN: {action}")
        qpos = robot.qpos
        for p in parts:
            a = p["mid"] + p["half"] * np.clip(action[p["start"]:p["end"]], -1, 1)
            start_qpos = qpos[p["idx"]][None]
            c = p["c"]
            if p["mimic"]:
                target = c._target_qpos.numpy().copy()
                target[:, p["control"]] = a
                target[:, p["mimic_idx"]] = target[:, p["mimic_src"]] * p["mult"][None] + p["offset"][None]
            else:
                target = start_qpos + a if p["delta"] else np.broadcast_to(a, start_qpos.shape).copy()
            c._step, c._start_qpos, c._target_qpos = 0, torch.from_numpy(start_qpos), torch.from_numpy(target)
            for i, joint in enumerate(p["joints"]):
                joint.drive_target = target[0, i:i + 1]

    return set_action


def _maniskill_compute(base) -> Callable:
    """ManiSkill's own observation, reward and success after a control step (what `BaseEnv.step` does after
    `_step_action`), for env tasks without a computation here."""
    def compute(action):
        info = base.get_info()
        obs = base.get_obs(info, unflattened=True)
        reward = base.get_reward(obs=obs, action=action, info=info)
        obs = base._flatten_raw_obs(obs)
        success = bool(info["success"].reshape(-1)[0])
        failed = bool(info["fail"].reshape(-1)[0]) if "fail" in info else False
        return obs.reshape(-1).numpy().astype(np.float32, copy=False), float(reward.reshape(-1)[0]), \
            success or failed, success
    return compute


def fast_step_for(env) -> Optional[FastStep]:
    """A fast `step` for the ManiSkill env `env` (a `gym.make` result), or None where nothing here applies (a GPU
    simulator, several envs in one instance, an obs mode other than `state`, or neither part below).

    Two parts, each used where it applies, ManiSkill's own code for the other:
    * the controller (`_fast_controller`: Panda's joint-position controllers, e.g. `pd_joint_delta_pos`);
    * the env task's observation, success and reward (`_TASKS`: PushCube-v1, PickCube-v1), with a
      `normalized_dense` or `dense` reward, the Panda and no controller state in the observation.

    The returned function takes a float32 [D] action and returns (obs float32 [O], reward float, terminated bool,
    truncated bool, success bool), the values `env.step` returns (module docstring): terminated = success, as the
    covered env tasks define no failure; with ManiSkill's computation, success or fail as `BaseEnv.step`."""
    import torch
    base = env.unwrapped
    if base.gpu_sim_enabled or base.num_envs != 1 or base.obs_mode != "state":
        return None
    make = _TASKS.get(getattr(base.spec, "id", None) if base.spec else None)
    own = (make is not None and base._reward_mode in ("normalized_dense", "dense") and base.robot_uids == "panda"
           and not isinstance(base.agent.controller, dict) and len(base.agent.controller.get_state()) == 0)
    set_action = _fast_controller(base)
    if set_action is None and not own:
        return None
    if set_action is None:
        set_action = lambda a: base.agent.set_action(torch.from_numpy(a).reshape(1, -1))  # noqa: E731
    compute = make(base) if own else None
    maniskill = None if own else _maniskill_compute(base)
    limit = _time_limit(env)

    def step(action: np.ndarray):
        action = np.asarray(action, np.float32).reshape(-1)
        set_action(action)
        base._step_action(None)  # no action: ManiSkill's control-step hooks and physics sub-steps only
        base._elapsed_steps += 1
        if compute is not None:
            obs, reward, success = compute()
            terminated = success
        else:
            obs, reward, terminated, success = maniskill(torch.from_numpy(action).reshape(1, -1))
        base._last_obs = torch.from_numpy(obs[None])
        truncated = limit is not None and int(base._elapsed_steps[0]) >= limit
        return obs, reward, terminated, truncated, success

    return step
