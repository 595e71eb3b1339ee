"""The scripted LIBERO expert (tasks/envs/libero/expert.py) and its recording (`record.teacher=scripted:libero`):
offline checks of the teacher spec and of the tasks' goals; on the real simulator (one env, libero_object task 0)
the expert succeeds by LIBERO's own check and its actions, replayed from the same init state, reach that goal at
the same step; (slow) `pipelines.record conf=libero_record` writes a readable store whose per-task success is what
LIBERO's check gives for the stored actions replayed."""
from __future__ import annotations

import numpy as np
import pytest

from tasks.config import ConfigError
from tasks.envs.libero.configuration import LiberoEnvConfig
from tasks.envs.maniskill.configuration import ManiSkillEnvConfig
from tasks.envs import check_scripted_teacher, is_scripted_teacher
import tasks.envs.libero.adapter as L
import tasks.envs.libero.expert as X


def _cfg(suite="libero_object", tasks=(0,), obs_mode="state", **kw) -> LiberoEnvConfig:
    return LiberoEnvConfig(simulator="libero", env_id=suite, obs_mode=obs_mode, image_size=32, control_mode="OSC_POSE",
                     reward_mode="sparse", sim_backend="cpu", task_ids=list(tasks), **kw)


# ----- offline -----

def test_teacher_spec_names_a_known_expert_of_the_env_simulator():
    assert is_scripted_teacher("scripted:libero") and not is_scripted_teacher("runs/x/y")
    assert not is_scripted_teacher(None)
    check_scripted_teacher("scripted:libero", _cfg(tasks=(0, 1)))  # no error
    with pytest.raises(ConfigError, match="no scripted expert 'nope'"):
        check_scripted_teacher("scripted:nope", _cfg())
    with pytest.raises(ConfigError, match="drives env.simulator=libero"):
        check_scripted_teacher("scripted:libero", ManiSkillEnvConfig())  # the default env: ManiSkill


def test_only_tasks_with_one_in_or_on_goal_of_a_movable_object_are_accepted():
    """libero_object and libero_spatial goals are all `in`/`on` of a movable object; libero_goal's tasks 'open the
    middle drawer' style goals are not: read from each task's BDDL file."""
    from libero.libero.envs.bddl_utils import robosuite_parse_problem  # noqa: F401 (LIBERO installed)
    for suite in ("libero_object", "libero_spatial"):
        X.check_tasks(_cfg(suite, tasks=range(10)))
    goal = L.suite("libero_goal")
    bad = [t for t in range(goal.n_tasks) if not goal.get_task(t).language.startswith(("put", "push"))]
    assert bad  # 'open the ...', 'turn on the stove': not pick-and-place
    with pytest.raises(ConfigError, match=r"env\.task_ids.*task\(s\) \[" + str(bad[0]) + r"\]"):
        X.check_tasks(_cfg("libero_goal", tasks=[bad[0]]))


def test_goal_of_refuses_goals_the_expert_does_not_handle():
    class Env:
        objects_dict = {"bowl_1": None}

    for goal in ([["open", "drawer_1"]], [["on", "bowl_1", "plate_1"], ["on", "cup_1", "plate_1"]],
                 [["on", "plate_1", "bowl_1"]]):  # a fixture / unknown object as the thing to move
        Env.parsed_problem = {"goal_state": goal}
        with pytest.raises(ValueError, match="one 'in'/'on' goal"):
            X.goal_of(Env)
    Env.parsed_problem = {"goal_state": [["On", "bowl_1", "plate_1"]]}
    assert X.goal_of(Env) == ("on", "bowl_1", "plate_1")


def test_action_noise_perturbs_the_motion_dims_per_episode_seed_and_never_the_gripper(monkeypatch):
    """record.action_noise: the executed (and stored) action is the expert's plus N(0, sigma) on dims 0-5, clipped to
    [-1, 1], from a generator seeded by the episode's reset seed; the gripper dim is the expert's."""
    clean = np.array([0.2, -0.3, 0.95, 0.0, 0.01, -0.02, 1.0], np.float32)

    class Shard:
        num_envs, action_dim = 2, 7
        envs = [None, None]
        seeds, ids = np.array([11, 12]), np.array([0, 1])

        def current_episodes(self):
            return self.seeds, self.ids

    monkeypatch.setattr(X, "problem_env", lambda env: None)
    monkeypatch.setattr(X.PickPlaceExpert, "reset", lambda self, env: None)
    monkeypatch.setattr(X.PickPlaceExpert, "act", lambda self, env: clean.copy())

    def actions(sigma, seeds=(11, 12), steps=400):
        sh = Shard()
        sh.seeds = np.array(seeds)
        ex = X.ShardExpert(sh, action_noise=sigma)
        return np.stack([ex.act(sh)[:, 0] for _ in range(steps)])  # [steps, B, 7]

    np.testing.assert_array_equal(actions(0.0), np.broadcast_to(clean, (400, 2, 7)))
    a = actions(0.1)
    assert (a[..., 6] == 1.0).all() and (np.abs(a) <= 1.0).all()
    for b in range(2):
        expected = np.clip(clean[:6] + np.random.default_rng([11, 12][b]).normal(0.0, 0.1, (400, 6)), -1, 1)
        np.testing.assert_allclose(a[:, b, :6], expected, atol=1e-6)
    noise = a[:, :, [0, 1, 3, 4, 5]] - clean[[0, 1, 3, 4, 5]]  # dim 2 sits near the clip at +1
    assert abs(noise.std() - 0.1) < 0.01 and abs(noise.mean()) < 0.01
    np.testing.assert_array_equal(actions(0.1), a)  # the same seeds: the same recording
    assert not np.allclose(actions(0.1, seeds=(13, 14))[..., :6], a[..., :6])


def test_action_noise_is_checked_offline(tmp_path):
    from pipelines.config import load_config
    out = f"record.out={tmp_path / 'rec.zarr'}"
    with pytest.raises(ConfigError, match="must be >= 0") as e:
        load_config(["conf=libero_record", "record.action_noise=-0.1", out], command="record")
    assert e.value.key == "record.action_noise"
    with pytest.raises(ConfigError, match="scripted teachers") as e:
        load_config(["conf=pushcube_record", "record.teacher=runs/x/y", "record.action_noise=0.1", out],
                    command="record")
    assert e.value.key == "record.action_noise"
    load_config(["conf=libero_record", "record.action_noise=0.1", out], command="record")


# ----- real simulator -----

@pytest.fixture(scope="module")
def env():
    e = L.LiberoEnv(_cfg())
    yield e
    e.close()


@pytest.fixture(scope="module")
def episode(env):
    return X.expert_episode(env, 0, 0)


def test_expert_succeeds_by_libero_check(env, episode):
    """Init state 0 of 'pick up the alphabet soup and place it in the basket': the episode ends at LIBERO's success
    (the env's terminated = check_success()) before the step limit, with actions in [-1, 1]."""
    ep = episode
    assert ep["success"] and env.check_success() and ep["steps"] < env.max_steps
    assert ep["actions"].shape == (ep["steps"], 7) and np.abs(ep["actions"]).max() <= 1.0
    assert set(np.unique(ep["actions"][:, 6])) <= {-1.0, 1.0}  # the gripper: open / closed only


def test_gripper_phases_end_when_the_fingers_stop_not_after_a_step_count(env):
    """`close` and `open` end at the first step (from the 3rd on) whose finger-gap change since the previous step is
    below FINGER_STILL, so the phase that follows is a function of the observed state: while the gap still moves the
    expert holds, once it has stopped it lifts (or retreats) at once."""
    env.reset_to(0, 0)
    ex, sim = X.PickPlaceExpert(), X.problem_env(env)
    ex.reset(sim)
    phases, gaps = [], []
    for _ in range(env.max_steps):
        gaps.append(ex._finger_gap(sim))
        phases.append(ex.phase)
        a = ex.act(sim)
        _, _, success, truncated, _ = env.step(a)
        if success or truncated:
            break
    phases.append(ex.phase)
    gaps.append(ex._finger_gap(sim))
    moves = np.abs(np.diff(gaps))  # moves[i]: the gap change from step i to step i + 1
    for name, nxt in (("close", "lift"), ("open", "retreat")):
        idx = [i for i, p in enumerate(phases) if p == name]
        if name == "open" and (not idx or phases[-1] == "open"):
            continue  # the episode may end (success) while the fingers are still opening
        assert idx, f"no {name} phase"
        first, last = idx[0], idx[-1]
        assert phases[last + 1] == nxt
        assert 2 <= last - first < (X.CLOSE_STEPS if name == "close" else X.OPEN_STEPS)  # ended before its budget
        assert moves[last - 1] < X.FINGER_STILL  # the decision at `last` saw fingers that had stopped
        assert all(moves[i - 1] >= X.FINGER_STILL for i in range(first + 2, last))  # earlier: still moving


@pytest.mark.slow
def test_expert_actions_replay_to_the_same_success(env, episode):
    """The same actions from the same init state make check_success() false at every step before the episode's
    last and true at it (LIBERO's check is a function of the action sequence here)."""
    ep = episode
    env.reset_to(0, 0)
    checks = []
    for a in ep["actions"]:
        env.step(a)
        checks.append(env.check_success())
    assert checks[-1] and not any(checks[:-1])


# ----- the recording (slow: a cluster, two env builds in its worker and two here) -----

@pytest.mark.slow
def test_record_cli_writes_a_store_whose_per_task_success_is_libero_check_of_the_stored_actions(tmp_path):
    """`python -m pipelines.record conf=libero_record` (2 envs: task 0 and task 1, one round, with
    record.action_noise): the store opens with the recording's layout (32 px images, chunks of C=5 actions, the
    14-D object state, the close_positive gripper convention, the episode index with task_id / trial_id), and
    replaying each episode's executed (noisy) actions from its init state in a fresh env gives LIBERO's
    check_success() first true exactly where the store's success is."""
    from pipelines import record
    from storage.trajectories import TrajectoryStore
    out = tmp_path / "rec.zarr"
    assert record.main(["conf=libero_record", "record.num_episodes=2", f"record.out={out}", "env.num_envs=2",
                        "env.num_shards=1", "cluster.num_env_workers=1", "record.action_noise=0.1",
                        "runner.progress=false"]) == 0
    st = TrajectoryStore.open(str(out))
    attrs = st.attrs
    assert attrs["gripper_convention"] == "close_positive" and attrs["teacher_run"] == "scripted:libero"
    assert attrs["action_noise"] == 0.1 and attrs["libero"]["object_state"] and st.fields["obs"].shape == (14,)
    assert attrs["libero"]["task_ids"] == [0, 1] and attrs["episodes"] == 2
    index = attrs["episode_index"]
    assert sorted(e["task_id"] for e in index) == [0, 1] and all(e["trial_id"] == 0 for e in index)
    steps = st.complete_steps()
    assert list(steps) == [0]
    rgb, actions, mask, success = (st.read(k, steps)[0] for k in ("rgb", "actions", "step_mask", "success"))
    suite = attrs["env_id"]
    T = -(-L.SUITE_MAX_STEPS[suite] // 5)
    assert rgb.shape == (T, 2, 32, 32, 3) and rgb.dtype == np.uint8 and actions.shape == (T, 2, 5, 7)
    per_task_store, per_task_replay = {}, {}
    for b, e in enumerate(sorted(index, key=lambda e: e["episode_id"])):
        executed = actions[:, b][mask[:, b]]  # [L, 7] in time order
        assert len(executed) == e["episode_len"]
        env = L.LiberoEnv(_cfg(suite, tasks=[e["task_id"]]))
        env.reset_to(e["task_id"], e["trial_id"])
        checks = []
        for a in executed:
            env.step(a)
            checks.append(env.check_success())
        env.close()
        per_task_replay[e["task_id"]] = any(checks)
        per_task_store[e["task_id"]] = bool(success[:, b].any()) and e["success_once"]
        if any(checks):  # the episode ended at LIBERO's first success
            assert checks.index(True) == len(checks) - 1
    assert per_task_store == per_task_replay
