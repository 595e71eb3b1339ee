"""tasks.video on a fake rendering env (no simulator): captions, the return check, which episodes are filmed, and
errors coming back as one line instead of failing the evaluation. The real ManiSkill path (a smoke run filming its
eval episode, replay reproducing the eval's return) is tests/test_end_to_end.py::test_smoke_run_films_its_eval_episode."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import tasks.envs
from tasks import resident, video
from tasks.config import Config, ConfigError, replace_key, replace_keys
from tasks.config import check_config


class Env:
    """reward 0.5 per action, success from the 3rd action on; frame brightness 30 * t."""

    fps = 20.0

    def __init__(self, size=64):
        self.size, self.t = size, 0

    def reset(self, seed):
        self.t = 0
        return np.zeros(3, np.float32)

    def step(self, action):
        self.t += 1
        return np.zeros(3, np.float32), 0.5, False, False, self.t >= 3

    def render_frame(self):
        return np.full((self.size, self.size, 3), 30 * self.t, np.uint8)


def _episode(i, n=4, ret=None):
    return {"episode_id": i, "seed": 100 + i, "actions": np.zeros((n, 2), np.float32),
            "return": 0.5 * n if ret is None else ret, "episode_len": n}


@pytest.fixture(autouse=True)
def clean_resident():
    resident.release("")
    yield
    resident.release("")


def test_caption_draws_a_black_bar_with_white_text():
    img = np.full((64, 64, 3), 128, np.uint8)
    out = video.caption(img, ["PushCube-v1 eval at step 3", "t 1/50 reward 0.1"])
    bar = out[:video.CAPTION_PX].astype(int)
    assert out.shape == img.shape and (out[video.CAPTION_PX + 1:] == 128).all()  # the scene is untouched
    assert (bar.max(axis=-1) == 0).mean() > 0.5 and (bar.min(axis=-1) > 200).any()  # text: ~30 % of 64 px
    assert (img == 128).all()  # a new array


def test_write_episode_video_replays_and_checks_the_return(tmp_path):
    import imageio.v2 as imageio
    v = video.write_episode_video(Env(), _episode(0), tmp_path / "a" / "e.mp4", "title")
    assert v["frames"] == 3 and v["fps"] == 10.0  # 20 Hz control: a frame every 2nd action, t = 0, 2, 4
    assert v["return"] == 2.0 and v["return_matches"] and v["success_once"]  # every action is replayed
    frames = np.stack(imageio.mimread(v["path"], memtest=False))
    np.testing.assert_allclose(frames[:, 30:].reshape(3, -1).mean(axis=1), [0, 60, 120], atol=6)
    # the eval said another return: the replay did not reproduce it
    assert not video.write_episode_video(Env(), _episode(1, ret=2.5), tmp_path / "b.mp4", "t")["return_matches"]
    assert not video.write_episode_video(Env(), _episode(1, n=2), tmp_path / "c.mp4", "t")["success_once"]


def test_frame_steps_keep_real_time_at_most_max_fps():
    assert video.frame_steps(50, 20.0) == (list(range(0, 51, 2)), 10.0)
    assert video.frame_steps(5, 20.0) == ([0, 2, 4, 5], 10.0)  # the last action always gets its frame
    assert video.frame_steps(5, 10.0) == ([0, 1, 2, 3, 4, 5], 10.0)
    assert video.frame_steps(3, 5.0) == ([0, 1, 2, 3], 5.0)  # slower control: every action, its own rate
    assert video.frame_steps(7, 60.0) == ([0, 6, 7], 10.0)


def test_eval_videos_films_the_lowest_episode_ids_and_never_raises(monkeypatch, tmp_path):
    cfg = replace_keys(Config(), {"runner.eval_videos": 2, "runner.eval_video_size": 64})
    made = []
    monkeypatch.setattr(tasks.envs, "make_single_env",
                        lambda c, render_size=None: made.append(render_size) or Env(render_size))
    no_actions = {**_episode(0), "actions": None}
    out = video.eval_videos(cfg, "run-v", str(tmp_path), 4, [_episode(3), _episode(1)], [no_actions, _episode(2)])
    assert out["error"] is None and [v["episode_id"] for v in out["videos"]] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["episode_1.mp4", "episode_2.mp4"]
    video.eval_videos(cfg, "run-v", str(tmp_path), 5, [_episode(1)])
    assert made == [64]  # the render instance stays resident across evaluations of the run

    def broken(c, render_size=None):
        raise RuntimeError("vk::createInstance failed")
    monkeypatch.setattr(tasks.envs, "make_single_env", broken)
    out = video.eval_videos(cfg, "run-w", str(tmp_path), 4, [_episode(1)])
    assert out["videos"] == [] and out["error"] == "RuntimeError: vk::createInstance failed"
    out = video.eval_videos(cfg, "run-w", str(tmp_path), 4, [{**_episode(1), "actions": None}])
    assert out["videos"] == [] and "no eval episode carries its actions" in out["error"]


class TaskEnv(Env):
    """A multi-task Env (as LIBERO's): the reset seed selects the task; another task than the instance's costs a
    rebuild, counted."""

    def __init__(self, size=64):
        super().__init__(size)
        self.task_id, self.builds = None, 0

    def reset(self, seed):
        task = (seed - 100) % 2  # _episode(i): seed 100 + i, task i % 2
        if task != self.task_id:
            self.task_id, self.builds = task, self.builds + 1
        return super().reset(seed)


def test_eval_videos_film_task_by_task_starting_with_the_instance_task(monkeypatch, tmp_path):
    cfg = replace_keys(Config(), {"runner.eval_videos": 4, "runner.eval_video_size": 64})
    env = TaskEnv()
    monkeypatch.setattr(tasks.envs, "make_single_env", lambda c, render_size=None: env)
    eps = [{**_episode(i), "task_id": i % 2} for i in range(6)]  # eval layout: env i % 2 plays task i % 2
    out = video.eval_videos(cfg, "run-t", str(tmp_path), 4, eps[0::2], eps[1::2])
    assert out["error"] is None and [v["episode_id"] for v in out["videos"]] == [0, 2, 1, 3]
    assert env.builds == 2  # task 0 then task 1; in episode-id order 0, 1, 2, 3 it would be 4 builds
    out = video.eval_videos(cfg, "run-t", str(tmp_path), 5, eps[0::2], eps[1::2])
    assert [v["episode_id"] for v in out["videos"]] == [1, 3, 0, 2] and env.builds == 3  # the instance's task 1 first


def test_eval_video_keys_are_checked_and_counted():
    from pipelines.graphs import eval_video_count
    for key, value in (("eval_videos", -1), ("eval_video_size", 16), ("eval_video_size", 4096),
                       ("eval_video_interval", 0)):
        cfg = replace_key(Config(), f"runner.{key}", value)
        with pytest.raises(ConfigError, match=f"runner.{key}"):
            check_config(cfg)
    cfg = replace_keys(Config(), {"env.eval.num_episodes": 3, "runner.eval_videos": 5})
    assert eval_video_count(cfg) == 3  # at most the eval's episodes
    cfg = replace_key(cfg, "runner.eval_videos", 0)
    assert eval_video_count(cfg) == 0
    cfg = replace_keys(cfg, {"runner.eval_videos": 2, "env.sim_backend": "physx_cuda"})
    assert eval_video_count(cfg) == 0  # no action log to replay


def test_films_eval_at_multiples_of_the_interval_and_at_the_last_step():
    """runner.eval_video_interval: a training run's eval films when its step is a multiple of the interval (the
    step-0 eval too), is runner.max_steps or is the run's last eval; never with runner.eval_videos=0."""
    from pipelines.graphs import films_eval
    cfg = replace_keys(Config(), {"runner.eval_videos": 1, "runner.max_steps": 205, "runner.eval_video_interval": 50})
    filmed = [s for s in range(0, 206, 5) if films_eval(cfg, s)]
    assert filmed == [0, 50, 100, 150, 200, 205]
    assert films_eval(cfg, 35, last=True)  # the run's last eval, ended before max_steps (max_env_steps, wall time)
    cfg = replace_key(cfg, "runner.eval_video_interval", 1)
    assert all(films_eval(cfg, s) for s in range(0, 206, 5))
    cfg = replace_key(cfg, "runner.eval_videos", 0)
    assert not any(films_eval(cfg, s, last=True) for s in range(0, 206, 5))


def test_mp4_writer_writes_h264_through_ffmpeg_and_names_the_missing_package(tmp_path, monkeypatch):
    """tasks.video.mp4_writer: frames written are read back at the fps asked for; without imageio-ffmpeg a clear
    error names the package (imageio would otherwise pick a plugin by the extension; a TIFF writer was seen)."""
    import imageio.v3 as iio

    from tasks.video import mp4_writer
    frames = np.zeros((3, 32, 48, 3), np.uint8)
    frames[1, :, :16] = 255
    with mp4_writer(tmp_path / "a.mp4", 12.5, quality=7) as w:
        for f in frames:
            w.append_data(f)
    meta = iio.immeta(tmp_path / "a.mp4", plugin="FFMPEG")
    assert meta["fps"] == 12.5 and meta["codec"] == "h264"
    back = iio.imread(tmp_path / "a.mp4", plugin="FFMPEG")
    assert back.shape == (3, 32, 48, 3) and back[1, :, :16].mean() > 200 and back[0].mean() < 20
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # an import of it raises ImportError
    with pytest.raises(RuntimeError, match="imageio-ffmpeg"):
        mp4_writer(tmp_path / "b.mp4", 20.0, quality=7)
    assert not (tmp_path / "b.mp4").exists()
