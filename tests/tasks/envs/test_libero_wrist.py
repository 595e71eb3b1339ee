"""LIBERO's wrist camera (env.wrist_camera; tasks/envs/libero/adapter.py): the config rule (a family that reads one
camera is refused, naming the key), the trajectory field's shape, the policy's two camera keys; on the real simulator
(libero_spatial task 5): the images are [2, S, S, 3] = (agentview, wrist), each robosuite's raw OpenGL render of its
camera rotated 180 degrees, i.e. openpi's `obs["robot0_eye_in_hand_image"][::-1, ::-1]`."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.config import ConfigError


def _load(*overrides):
    from pipelines.config import load_config
    return load_config(list(overrides), components=False)[0]


def test_a_family_reading_one_camera_is_refused_naming_env_wrist_camera():
    with pytest.raises(ConfigError, match="env.wrist_camera") as e:
        _load("conf=libero_smoke", "env.wrist_camera=true", "policy=token_vla_tiny")  # token_vla: cameras = 1
    assert "token_vla" in str(e.value) and "wrist_camera=false" in str(e.value)
    with pytest.raises(ConfigError, match="env.wrist_camera"):
        _load("conf=libero_smoke", "env.wrist_camera=true", "env.obs_mode=state", "policy=mlp")
    # pi0 declares two cameras: the LIBERO RL confs validate (offline, no checkpoint, CPU)
    for conf in ("libero_pi0_ppo", "libero_pi05_ppo", "libero_pi0_grpo"):
        cfg = _load(f"conf={conf}", "policy.model_path=null", "policy.device=cpu", "policy.dtype=float32")
        assert cfg.env.wrist_camera and type(cfg.policy).cameras == 2


def test_the_rgb_field_holds_both_cameras_and_the_policy_sees_two_keys():
    from tasks.prompts import CAMERA_KEYS, policy_obs
    from tasks.trajectory import FIELDS, Dims
    cfg = _load("conf=libero_pi0_ppo", "policy.model_path=null", "policy.device=cpu", "policy.dtype=float32",
                "env.image_size=32")
    d = Dims.from_config(cfg, obs_dim=8, action_dim=7)
    rgb = next(f for f in FIELDS if f.name == "rgb")
    assert d.num_cameras == 2 and rgb.shape(d) == (2, 32, 32, 3)
    assert rgb.shape(Dims.from_config(_load("conf=libero_smoke"), obs_dim=8, action_dim=7)) == (32, 32, 3)
    imgs = np.arange(3 * 2 * 4 * 4 * 3, dtype=np.uint8).reshape(3, 2, 4, 4, 3)  # [B, K, H, W, 3]
    obs = policy_obs(torch.nn.Module(), np.zeros((3, 8), np.float32), imgs, "task")
    assert CAMERA_KEYS == ("rgb", "wrist_rgb")
    assert torch.equal(obs["rgb"], torch.as_tensor(imgs[:, 0])) and torch.equal(obs["wrist_rgb"],
                                                                                torch.as_tensor(imgs[:, 1]))
    one = policy_obs(torch.nn.Module(), np.zeros((3, 8), np.float32), imgs[:, 0], "task")
    assert "wrist_rgb" not in one and torch.equal(one["rgb"], obs["rgb"])


def test_the_wrist_image_reaches_a_pi0_policy_as_its_second_camera():
    """The env's [B, 2, H, W, 3] images through policy_obs into a tiny pi0 with LIBERO's dims: two cameras in the
    prefix (pixel_attention_mask [B, 2], all present), and the ODE's actions from the same initial noise change
    when only the wrist image does (it is read), not when nothing does."""
    from tasks.policies import make_policy
    from tasks.prompts import policy_obs
    from tasks.rollout import image_size, num_values
    cfg = _load("conf=libero_pi0_ppo", "policy.model_path=null", "policy.preset=tiny", "policy.device=cpu",
                "policy.dtype=float32", "env.image_size=32", "policy.max_prompt_len=128")
    torch.manual_seed(0)
    pol = make_policy(cfg.policy, obs_dim=8, action_dim=7, num_values=num_values(cfg), image_size=image_size(cfg),
                      load=False)
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (2, 2, 32, 32, 3), dtype=np.uint8)  # [B, K, H, W, 3]
    state = rng.standard_normal((2, 8)).astype(np.float32)
    obs = policy_obs(pol, state, imgs, "put the bowl on the plate")
    assert pol._inputs(obs)["pixel_attention_mask"].tolist() == [[True, True]] * 2
    other = imgs.copy()
    other[:, 1] = 255 - other[:, 1]  # another wrist image, the same agentview
    noise = torch.randn(2, pol.T, pol.A)
    with torch.no_grad():
        a = pol.act(obs, deterministic=True, noise=noise)["actions"]
        again = pol.act(policy_obs(pol, state, imgs.copy(), "put the bowl on the plate"), deterministic=True,
                        noise=noise)["actions"]
        b = pol.act(policy_obs(pol, state, other, "put the bowl on the plate"), deterministic=True,
                    noise=noise)["actions"]
    assert torch.equal(a, again) and not torch.allclose(a, b)


@pytest.fixture(scope="module")
def wrist_env():
    from tasks.envs.libero.adapter import LiberoEnv
    from tasks.envs.libero.configuration import LiberoEnvConfig
    cfg = LiberoEnvConfig(simulator="libero", env_id="libero_spatial", obs_mode="rgb", image_size=32,
                          control_mode="OSC_POSE", reward_mode="sparse", sim_backend="cpu", task_ids=[5],
                          wrist_camera=True)
    e = LiberoEnv(cfg)
    yield e
    e.close()


def test_the_wrist_camera_is_rendered_beside_the_agentview_rotated_as_openpi_feeds_it(wrist_env):
    import robosuite.macros as macros
    import tasks.envs.libero.adapter as L
    env = wrist_env
    env.reset_to(5, 0)
    assert env.image_shape == (2, 32, 32, 3)
    imgs = env.render_rgb()
    assert imgs.shape == (2, 32, 32, 3) and imgs.dtype == np.uint8
    # robosuite's camera observations are the raw OpenGL render (upside down) under this convention, so openpi's
    # `obs["robot0_eye_in_hand_image"][::-1, ::-1]` is the raw render turned by 180 degrees
    assert macros.IMAGE_CONVENTION == "opengl"
    with L.gl_current(env.env):
        raw = {cam: env.env.sim.render(width=32, height=32, camera_name=cam)[..., :3]
               for cam in ("agentview", "robot0_eye_in_hand")}
    np.testing.assert_array_equal(imgs[0], raw["agentview"][::-1, ::-1])
    np.testing.assert_array_equal(imgs[1], raw["robot0_eye_in_hand"][::-1, ::-1])
    assert not np.array_equal(imgs[0], imgs[1]) and imgs[1].std() > 5  # two views, the wrist one not blank
    # the wrist camera moves with the gripper; the agentview camera is fixed: after moving the arm up, only the
    # scene, not the agentview camera, changed; the wrist image changes with the arm
    for _ in range(5):
        env.step(np.array([0, 0, 1, 0, 0, 0, -1], np.float32))
    after = env.render_rgb()
    assert not np.array_equal(after[1], imgs[1])
