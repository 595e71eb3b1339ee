"""env.robot_visual_lod (tasks.envs.maniskill.mesh_lod): decimated robot visual meshes change what the camera sees a little and
the dynamics not at all; the cached build is deterministic and never half-written; the RGB-only capture gives
ManiSkill's pixels."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.config import ConfigError
from tasks.envs.maniskill.configuration import ManiSkillEnvConfig


@pytest.fixture(scope="module")
def panda_urdf() -> Path:
    import importlib
    from mani_skill import format_path
    panda = importlib.import_module("mani_skill.agents.robots.panda.panda").Panda
    return Path(format_path(str(panda.urdf_path)))


def _faces(path: Path) -> int:
    import trimesh
    s = trimesh.load(str(path))
    return sum(len(g.faces) for g in s.geometry.values()) if isinstance(s, trimesh.Scene) else len(s.faces)


def test_decimated_urdf_is_deterministic_keeps_collision_meshes_and_cuts_visual_faces(panda_urdf, tmp_path):
    from tasks.envs.maniskill.mesh_lod import _mesh_refs, decimated_urdf
    a = decimated_urdf(panda_urdf, 0.1, root=tmp_path / "a")
    b = decimated_urdf(panda_urdf, 0.1, root=tmp_path / "b")
    assert a.name == panda_urdf.name and a.read_bytes() == panda_urdf.read_bytes()  # joints, inertias unchanged
    text = panda_urdf.read_text()
    visual, collision = _mesh_refs(text, "visual"), _mesh_refs(text, "collision")
    assert len(visual) >= 9 and len(collision) >= 9
    for rel in collision:  # the physics reads the very same files
        assert (a.parent / rel).is_symlink() and (a.parent / rel).resolve() == (panda_urdf.parent / rel).resolve()
    before = after = 0
    for rel in sorted(set(visual)):
        assert not (a.parent / rel).is_symlink()
        assert (a.parent / rel).read_bytes() == (b.parent / rel).read_bytes()  # same input -> same bytes
        before, after = before + _faces(panda_urdf.parent / rel), after + _faces(a.parent / rel)
    assert 0.05 * before < after < 0.15 * before  # ~10 % of the faces (each sub-mesh >= 12)
    # cached: a second call returns the existing copy; no temporary directory is left behind
    assert decimated_urdf(panda_urdf, 0.1, root=tmp_path / "a") == a
    assert [p.name for p in (tmp_path / "a" / "robot_lod").iterdir()] == [a.parent.name]
    with pytest.raises(ValueError, match="fraction"):
        decimated_urdf(panda_urdf, 0.0, root=tmp_path)


def test_concurrent_builds_of_one_key_leave_one_complete_copy(panda_urdf, tmp_path):
    """Two processes building the same copy at once (two env workers' first env): both get a complete URDF and only
    one directory remains."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        paths = pool.starmap(_build, [(str(panda_urdf), str(tmp_path))] * 2)
    assert paths[0] == paths[1] and Path(paths[0]).is_file()
    assert [p.name for p in (tmp_path / "robot_lod").iterdir()] == [Path(paths[0]).parent.name]


def _build(urdf: str, root: str) -> str:
    from tasks.envs.maniskill.mesh_lod import decimated_urdf
    return str(decimated_urdf(urdf, 0.2, root=Path(root)))


def _episode(lod: float, seed: int = 4, steps: int = 12):
    from tasks.envs.maniskill.adapter import ManiSkillEnv
    env = ManiSkillEnv(ManiSkillEnvConfig(env_id="PushCube-v1", obs_mode="rgb", image_size=32, robot_visual_lod=lod))
    rng = np.random.default_rng(0)
    obs, imgs = [np.concatenate([env.reset(seed), np.zeros(4)])], [env.render_rgb()]
    for t in range(steps):
        out = env.step(rng.uniform(-1, 1, env.action_dim).astype(np.float32))
        obs.append(np.concatenate([out[0], [out[1], out[2], out[3], out[4]]]))
        if t % 4 == 3:
            imgs.append(env.render_rgb())
    ref = env.env.unwrapped._get_obs_sensor_data()["base_camera"]["rgb"].reshape(32, 32, 3).numpy()
    env.close()
    return np.stack(obs), np.stack(imgs).astype(np.int16), ref, imgs[-1]


def test_lod_keeps_the_dynamics_bit_exact_and_the_image_close(monkeypatch, tmp_path):
    import importlib
    monkeypatch.setenv("DAGRL_CACHE", str(tmp_path))
    panda = importlib.import_module("mani_skill.agents.robots.panda.panda").Panda
    original = panda.urdf_path
    full_obs, full_img, ref, last = _episode(1.0)
    # the RGB-only capture gives exactly ManiSkill's own sensor path's pixels
    np.testing.assert_array_equal(last, ref)
    lod_obs, lod_img, _, _ = _episode(0.1)
    assert panda.urdf_path == original  # the class is restored after the env is built
    np.testing.assert_array_equal(full_obs, lod_obs)  # states, rewards, flags: bit-identical
    d = np.abs(full_img - lod_img)
    assert d.max() > 0  # the decimated meshes are what the camera renders after reset and steps
    assert d.mean() < 2.0 and (d.max(-1) > 16).mean() < 0.05  # ~1 px at the arm's silhouette (measured 0.8 / 2 %)
    assert any(p.name.startswith("panda_v2-") for p in (tmp_path / "robot_lod").iterdir())


def test_robot_visual_lod_is_validated():
    from tasks.config import Config
    from tasks.config.checks import check_config  # the family's rules run with every config check
    with pytest.raises(ConfigError, match="env.robot_visual_lod"):
        check_config(Config(env=ManiSkillEnvConfig(robot_visual_lod=0.0)))
    with pytest.raises(ConfigError, match="env.robot_visual_lod"):
        check_config(Config(env=ManiSkillEnvConfig(robot_visual_lod=1.5)))
    check_config(Config(env=ManiSkillEnvConfig(robot_visual_lod=0.1)))


def test_robot_visual_lod_refused_where_no_urdf(monkeypatch):
    import tasks.envs.maniskill.mesh_lod as mesh_lod
    assert mesh_lod.robot_agent_class("PushCube-v1").__name__ == "Panda"
    monkeypatch.setattr(mesh_lod, "robot_agent_class", lambda env_id: None)  # a robot-less env task
    with pytest.raises(ValueError, match="no URDF"):
        with mesh_lod.robot_lod("PushCube-v1", 0.5):
            pass
    with mesh_lod.robot_lod("PushCube-v1", 1.0):  # 1.0: nothing to do, nothing checked
        pass
