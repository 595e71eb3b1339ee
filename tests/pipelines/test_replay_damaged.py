"""pipelines.replay on a damaged trajectory store and with a --video path that cannot be written: exit 2 with one
line `error: ...` naming the store / path, before any simulation (no traceback, no false MISMATCH).

The stores are written here through the store's own write path (`TrajectoryStore.create`, `write_shard`,
`mark_complete`) with the replay fields of `tasks.trajectory`; no simulator runs: `tasks.envs.make_single_env` is
replaced by a stub whose reset raises `Simulated`, so reaching the simulation is visible and costs nothing.
"""
from __future__ import annotations

import numpy as np
import pytest

from pipelines import replay
from storage.trajectories import TrajectoryStore, clear_cache, write_shard
from tasks import trajectory

T, B, S, N = 4, 4, 2, 3  # chunk steps, envs, shard size (2 shards), complete steps
O, D = 5, 3  # obs and action dims


class Simulated(Exception):
    """The stub simulator was asked to simulate."""


class StubEnv:
    obs_dim, action_dim = O, D

    def reset(self, seed):
        raise Simulated(seed)

    def step(self, action):
        raise Simulated(action)

    def close(self):
        pass


@pytest.fixture
def no_simulator(monkeypatch):
    """make_single_env -> StubEnv (counted in the returned list); ManiSkill is not imported."""
    import tasks.envs
    made = []

    def make(cfg, render_size=None):
        made.append(render_size)
        return StubEnv()

    monkeypatch.setattr(tasks.envs, "make_single_env", make)
    monkeypatch.setattr(replay, "_prepare_env", lambda cfg: None)
    return made


def _store(path, steps=N):
    """A run-like store: `steps` complete steps, one never-ending episode per env (id g, seed g: partial)."""
    dims = trajectory.Dims(obs_dim=O, action_dim=D, num_action_chunks=1, num_values=1, image_size=None)
    fields = trajectory.zarr_schema(dims, (*trajectory.REPLAY_FIELDS, "task_id", "trial_id"))
    st = TrajectoryStore.create(path, fields=fields, T=T, num_envs=B, shard_size=S,
                                attrs={"env_id": "PushCube-v1", "simulator": "maniskill", "obs_mode": "state",
                                       "gripper_convention": "open_positive",
                                       "control_mode": "pd_joint_delta_pos", "reward_mode": "normalized_dense",
                                       "base_seed": 0})
    rng = np.random.default_rng(0)
    for n in range(steps):
        attempt = st.reserve(n)
        for s in range(B // S):
            envs = np.arange(s * S, (s + 1) * S)
            data = {}
            for name, spec in fields.items():
                shape = (T, S, *spec.shape)
                if name in ("episode_id", "episode_seed"):
                    data[name] = np.broadcast_to(envs, (T, S)).astype(spec.dtype)
                elif name in ("task_id", "trial_id"):  # ManiSkill's one task, no trials
                    data[name] = np.full(shape, 0 if name == "task_id" else -1, spec.dtype)
                elif name == "step_mask":
                    data[name] = np.ones(shape, bool)
                elif spec.dtype == "bool":
                    data[name] = np.zeros(shape, bool)
                else:
                    data[name] = rng.uniform(-1, 1, shape).astype(spec.dtype)
            write_shard(str(path), step=n, shard=s, data=data, attempt=attempt)
        st.mark_complete(n)
    clear_cache()
    return st


def _main(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = replay.main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err.strip()


def _one_error_line(err: str) -> None:
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err


def _chunk(store_path, field, step=2, shard=0):
    """The chunk file of (step, shard) of a field: the one the tester damaged was fields/actions c/2/0/0/0/0."""
    import zarr
    arr = zarr.open_array(str(store_path / "fields" / field), mode="r")
    f = store_path / "fields" / field / arr.metadata.encode_chunk_key((step, 0, shard) + (0,) * (arr.ndim - 3))
    assert f.is_file()
    return f


def _reaches_simulation(store_path, capsys) -> None:
    """The undamaged store passes every check and its replay gets as far as the simulator's reset."""
    with pytest.raises(Simulated):
        replay.main([str(store_path), "--episodes", "0-3"])
    capsys.readouterr()


@pytest.mark.parametrize("field", ["actions", "step_mask"])  # read per episode / read by the episode index
def test_missing_chunk_file_of_a_complete_step_exits_2_not_mismatch(tmp_path, capsys, no_simulator, field):
    """A deleted chunk file reads as zeros in zarr: replay must refuse the store, not report MISMATCH (a deleted
    step_mask chunk would even hide the episodes' steps)."""
    path = tmp_path / "trajectories.zarr"
    _store(path)
    _reaches_simulation(path, capsys)
    made = len(no_simulator)
    chunk = _chunk(path, field)
    chunk.unlink()
    rc, out, err = _main(capsys, path, "--episodes", "0-3")
    assert rc == 2 and out == ""
    _one_error_line(err)
    rel = chunk.relative_to(path / "fields" / field).as_posix()
    assert str(path) in err and f"fields/{field} chunk file {rel}" in err and "step 2, envs 0-1" in err
    assert "missing" in err and "re-record" in err
    assert len(no_simulator) == made  # refused before any simulator was made


@pytest.mark.parametrize("field", ["actions", "episode_id"])  # read per episode / read by the episode index
def test_garbled_chunk_file_exits_2_naming_it(tmp_path, capsys, no_simulator, field):
    """A chunk file overwritten with garbage: zstd fails to decode it; the error names the chunk, no traceback, and
    nothing is simulated (an episode's data is read before its reset)."""
    path = tmp_path / "trajectories.zarr"
    _store(path)
    _reaches_simulation(path, capsys)
    chunk = _chunk(path, field)
    chunk.write_bytes(np.random.default_rng(1).bytes(300))
    rc, out, err = _main(capsys, path, "--episodes", "0-3")  # StubEnv.reset would raise Simulated
    assert rc == 2 and out == ""
    _one_error_line(err)
    rel = chunk.relative_to(path / "fields" / field).as_posix()
    assert str(path) in err and f"fields/{field} chunk file {rel} (step 2, envs 0-1) cannot be decoded" in err
    assert "re-record" in err


def test_missing_array_metadata_exits_2_naming_the_field(tmp_path, capsys, no_simulator):
    path = tmp_path / "trajectories.zarr"
    _store(path)
    _reaches_simulation(path, capsys)
    made = len(no_simulator)
    (path / "fields" / "obs" / "zarr.json").unlink()
    rc, out, err = _main(capsys, path, "--episodes", "0-3")
    assert rc == 2 and out == ""
    _one_error_line(err)
    assert str(path) in err and "fields/obs" in err and "zarr.json" in err and "re-record" in err
    assert len(no_simulator) == made


def test_check_files_sees_only_complete_steps_by_default(tmp_path):
    """Unwritten chunks of a step that is not complete (reserved, one shard of two written) are not damage; asked
    for explicitly, they are reported. A whole store passes, decoded or not."""
    from storage.trajectories import DamagedStore
    path = tmp_path / "s.zarr"
    st = _store(path)
    st.check_files()
    st.check_files(decode=True)
    att = st.reserve(N)
    data = {name: np.zeros((T, S, *spec.shape), spec.dtype) for name, spec in st.fields.items()}
    write_shard(str(path), step=N, shard=0, data=data, attempt=att)
    clear_cache()
    st = TrajectoryStore.open(path)
    assert st.complete_steps().tolist() == list(range(N))
    st.check_files()
    with pytest.raises(DamagedStore, match=rf"fields/\w+ chunk file \S+ \(step {N}, envs 2-3\) is missing"):
        st.check_files(steps=[N])
    with pytest.raises(KeyError, match="known fields"):
        st.check_files(["nope"])


@pytest.mark.parametrize("kind", ["parent_is_a_file", "is_a_directory"])
def test_video_path_that_cannot_be_written_exits_2_before_replaying(tmp_path, capsys, no_simulator, kind):
    path = tmp_path / "trajectories.zarr"
    _store(path)
    if kind == "parent_is_a_file":  # like /etc/hostname/x.mp4
        (tmp_path / "afile").write_text("x")
        video = tmp_path / "afile" / "x.mp4"
    else:
        video = tmp_path / "v.mp4"
        video.mkdir()
    rc, out, err = _main(capsys, path, "--episodes", "0", "--video", video)
    assert rc == 2 and out == ""
    _one_error_line(err)
    assert err.startswith(f"error: --video {video}: ")
    assert no_simulator == []  # checked before the replay made any simulator


def test_video_in_a_missing_directory_is_created_only_when_written(tmp_path, capsys, no_simulator):
    """Like `pipelines.eval --out` (checked up front, created when written): a replay refused for another reason
    leaves no directory behind; when the video is written its new directories are created and reported."""
    from tasks.video import check_mp4_path
    video = tmp_path / "new" / "sub" / "x.mp4"
    check_mp4_path(video)
    path = tmp_path / "trajectories.zarr"
    _store(path)
    _chunk(path, "actions").unlink()
    rc, _, err = _main(capsys, path, "--episodes", "0", "--video", video)
    assert rc == 2 and "fields/actions" in err
    assert not (tmp_path / "new").exists()
    assert replay.make_parent(video) == tmp_path / "new"
    assert video.parent.is_dir()
    assert f"created {tmp_path / 'new'}" in capsys.readouterr().err
    assert replay.make_parent(video) is None  # exists now: nothing created, nothing said
    assert capsys.readouterr().err == ""
