"""storage.lerobot: reading the LeRobot v3.0 dataset the LeRobot library wrote (tests/fixtures/lerobot_tiny, its
values rebuilt from make_fixture.py's definitions), writing one and reading it back, and one clear line for a
malformed dataset."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from storage.lerobot import LeRobotFormatError, is_dataset, open_dataset, write_dataset

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_tiny"
CAMERA = "observation.images.rgb"
# the codec's error on these flat-coloured images (AV1 or H.264, yuv420p): chroma is kept at half resolution, so
# the square's edges blur; measured mean 0.8-1.2 levels, bound with margin (a shifted frame is ~1.7)
MEAN_ABS_TOLERANCE = 3.0


def _spec():
    spec = importlib.util.spec_from_file_location("make_fixture", FIXTURE / "make_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _nearest_frame(decoded: np.ndarray, refs: np.ndarray) -> np.ndarray:
    """For each decoded frame, the index of the reference frame it is nearest to (mean absolute difference)."""
    d = np.abs(decoded[:, None].astype(np.int16) - refs[None].astype(np.int16)).mean(axis=(2, 3, 4))
    return d.argmin(1)


def test_reads_the_dataset_the_lerobot_library_wrote():
    m = _spec()
    assert is_dataset(FIXTURE) and not is_dataset(FIXTURE / "meta")
    ds = open_dataset(FIXTURE)
    assert ds.fps == m.FPS and ds.cameras == [CAMERA]
    assert [e.length for e in ds.episodes] == list(m.LENGTHS)
    assert [ds.tasks[i] for i in sorted(ds.tasks)] == list(dict.fromkeys(m.TASKS))
    fr = ds.frames(["observation.state", "action", "episode_index", "frame_index", "task_index"])
    n = sum(m.LENGTHS)
    assert fr["index"].tolist() == list(range(n))
    want_ep = np.concatenate([np.full(L, e) for e, L in enumerate(m.LENGTHS)])
    want_f = np.concatenate([np.arange(L) for L in m.LENGTHS])
    np.testing.assert_array_equal(fr["episode_index"], want_ep)
    np.testing.assert_array_equal(fr["frame_index"], want_f)
    # float32 values stored as they were given: exact
    np.testing.assert_array_equal(fr["observation.state"], np.stack([m.state(e, f) for e, f in zip(want_ep, want_f)]))
    np.testing.assert_array_equal(fr["action"], np.stack([m.action(e, f) for e, f in zip(want_ep, want_f)]))
    assert [ds.tasks[int(fr["task_index"][e.start])] for e in ds.episodes] == list(m.TASKS)
    for e in ds.episodes:
        video = ds.video(CAMERA, e)
        refs = np.stack([m.image(e.index, f) for f in range(e.length)])
        assert video.shape == refs.shape and video.dtype == np.uint8
        assert np.abs(video.astype(int) - refs).mean() < MEAN_ABS_TOLERANCE
        np.testing.assert_array_equal(_nearest_frame(video, refs), np.arange(e.length))  # its own frame each
    assert ds.video(CAMERA, ds.episodes[1], size=16).shape == (m.LENGTHS[1], 16, 16, 3)


def _episodes(m, lengths=(7, 4)):
    return [{"state": np.stack([m.state(e, f) for f in range(L)]),
             "action": np.stack([m.action(e, f) for f in range(L)]),
             "images": {CAMERA: np.stack([m.image(e, f) for f in range(L)])}, "task": f"task {e % 2}",
             "reward": np.arange(L, dtype=np.float32) / 10, "done": np.arange(L) == L - 1,
             "success": np.arange(L) == L - 1} for e, L in enumerate(lengths)]


def test_a_written_dataset_reads_back_and_an_existing_directory_is_refused(tmp_path):
    m = _spec()
    eps = _episodes(m)
    out = tmp_path / "ds"
    info = write_dataset(out, eps, fps=10, robot_type="panda", extra_meta={"observation_every": 1})
    assert info["codebase_version"] == "v3.0" and info["total_frames"] == 11 and info["total_tasks"] == 2
    ds = open_dataset(out)
    assert ds.fps == 10 and [e.length for e in ds.episodes] == [7, 4] and ds.episodes[1].start == 7
    assert [e.tasks for e in ds.episodes] == [("task 0",), ("task 1",)]
    fr = ds.frames(["observation.state", "action", "next.reward", "next.done", "timestamp"])
    np.testing.assert_array_equal(fr["observation.state"], np.concatenate([e["state"] for e in eps]))
    np.testing.assert_array_equal(fr["action"], np.concatenate([e["action"] for e in eps]))
    np.testing.assert_array_equal(fr["next.reward"], np.concatenate([e["reward"] for e in eps]))
    assert fr["next.done"].sum() == 2
    np.testing.assert_allclose(fr["timestamp"][7:], np.arange(4) / 10, rtol=0, atol=1e-6)
    for e, ep in zip(ds.episodes, eps):  # each episode's frames out of the one file both share
        video = ds.video(CAMERA, e)
        assert np.abs(video.astype(int) - ep["images"][CAMERA]).mean() < MEAN_ABS_TOLERANCE
        np.testing.assert_array_equal(_nearest_frame(video, ep["images"][CAMERA]), np.arange(e.length))
    stats = json.loads((out / "meta" / "stats.json").read_text())
    np.testing.assert_allclose(stats["action"]["mean"], fr["action"].astype(np.float64).mean(0), rtol=1e-6)
    assert stats["action"]["count"] == [11] and np.shape(stats[CAMERA]["mean"]) == (3, 1, 1)
    assert json.loads((out / "meta" / "dagrl.json").read_text()) == {"observation_every": 1}
    with pytest.raises(FileExistsError, match="exists; choose a new output directory"):
        write_dataset(out, eps, fps=10)


def _broken(tmp_path, how: str) -> Path:
    d = tmp_path / "broken"
    shutil.copytree(FIXTURE, d)
    info = json.loads((d / "meta" / "info.json").read_text())
    if how == "version":
        info["codebase_version"] = "v2.1"
    elif how == "images":
        info["features"][CAMERA]["dtype"] = "image"
    elif how == "episodes":
        info["total_episodes"] = 5
    elif how == "data":
        (d / "data" / "chunk-000" / "file-000.parquet").unlink()
    elif how == "video":
        (d / "videos" / CAMERA / "chunk-000" / "file-000.mp4").write_bytes(b"not a video")
    (d / "meta" / "info.json").write_text(json.dumps(info))
    return d


@pytest.mark.parametrize("how, line", [
    ("version", r"meta/info.json has codebase_version='v2.1'; dagrl reads v3.0"),
    ("images", r"features\['observation.images.rgb'\] is stored as images in parquet"),
    ("episodes", r"meta/episodes lists 3 episodes, meta/info.json total_episodes=5"),
    ("data", r"data/chunk-000/file-000.parquet is missing"),
    ("video", r"videos/observation.images.rgb/chunk-000/file-000.mp4 cannot be decoded"),
])
def test_a_malformed_dataset_is_one_line_naming_the_file_and_field(tmp_path, how, line):
    d = _broken(tmp_path, how)
    with pytest.raises(LeRobotFormatError, match=line) as err:
        ds = open_dataset(d)
        ds.frames(["action"])
        ds.video(CAMERA, ds.episodes[0])
    assert "\n" not in str(err.value) and str(d) in str(err.value)
