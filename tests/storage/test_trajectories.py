import json
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from storage.trajectories import (
    SCHEMA_VERSION,
    FieldSpec,
    TrajectoryStore,
    clear_cache,
    describe,
    write_shard,
)

T, B, S = 4, 6, 3  # chunk steps, envs, shard size -> 2 shards
FIELDS = {
    "obs": FieldSpec(shape=(2, 5), dtype="float32"),
    "action": FieldSpec(shape=(7,), dtype="float32"),
    "reward": FieldSpec(shape=(), dtype="float32"),
    "terminated": FieldSpec(shape=(), dtype="bool"),
}
ATTRS = {"env_id": "PickCube-v1", "seeds": [1, 2], "reset_state_ids": [0, 1, 2, 3, 4, 5], "config_hash": "abc"}


def _shard_data(step, shard, fields=FIELDS):
    rng = np.random.default_rng(100 * step + shard)
    out = {}
    for name, spec in fields.items():
        shape = (T, S, *spec.shape)
        if spec.dtype == "bool":
            out[name] = rng.random(shape) < 0.5
        else:
            out[name] = rng.standard_normal(shape).astype(spec.dtype)
    return out


def _write_all(path, step, attempt=None):
    for s in range(B // S):
        write_shard(str(path), step=step, shard=s, data=_shard_data(step, s), attempt=attempt)


def _make(path):
    return TrajectoryStore.create(path, fields=FIELDS, T=T, num_envs=B, shard_size=S, attrs=ATTRS)


def _write_in_subprocess(args):
    path, step, shard = args
    return write_shard(path, step=step, shard=shard, data=_shard_data(step, shard))


def test_create_layout_and_chunks(tmp_path):
    store = _make(tmp_path / "traj")
    assert store.num_steps == 0
    assert store.fields == FIELDS
    assert store.attrs["schema_version"] == SCHEMA_VERSION == 2
    assert store.attrs["env_id"] == "PickCube-v1"
    assert store.attrs["reset_state_ids"] == [0, 1, 2, 3, 4, 5]
    assert "created_at" in store.attrs
    store.reserve(0)
    for name, spec in FIELDS.items():
        d = store.to_dask(name)
        assert d.shape == (1, T, B, *spec.shape)
        assert d.dtype == np.dtype(spec.dtype)
        arr = store._field_array(name)
        assert arr.chunks == (1, T, S, *spec.shape)
        # one dask chunk per (step, shard)
        assert d.chunks[:3] == ((1,), (T,), (S, S))


def test_two_shards_two_processes_round_trip(tmp_path):
    path = str(tmp_path / "traj")
    store = _make(path)
    store.reserve(1)
    jobs = [(path, e, s) for e in (0, 1) for s in (0, 1)]
    with ProcessPoolExecutor(max_workers=2) as pool:
        stats = list(pool.map(_write_in_subprocess, jobs))
    per_shard = sum(T * S * int(np.prod(spec.shape, dtype=int)) * np.dtype(spec.dtype).itemsize
                    for spec in FIELDS.values())
    assert [s["bytes"] for s in stats] == [per_shard] * 4
    assert all(s["seconds"] >= 0 for s in stats)
    for name in FIELDS:
        expected = np.stack([
            np.concatenate([_shard_data(e, 0)[name], _shard_data(e, 1)[name]], axis=1) for e in (0, 1)
        ])
        got = store.to_dask(name).compute()
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(store.read(name, steps=[1]), expected[1:2])
        np.testing.assert_array_equal(TrajectoryStore.open(path).read(name), expected)


def test_write_shard_in_dask_tasks_and_cache_reopens_after_reserve(tmp_path):
    dask = pytest.importorskip("dask")
    path = str(tmp_path / "traj")
    store = _make(path)
    clear_cache()
    for step in range(3):  # step 1 and 2 need the cached handle re-opened (E grew on the driver)
        store.reserve(step)
        tasks = [dask.delayed(write_shard)(path, step=step, shard=s, data=_shard_data(step, s)) for s in (0, 1)]
        dask.compute(*tasks, scheduler="threads")
        store.mark_complete(step, weight_version=step, global_step=10 * step)
    np.testing.assert_array_equal(store.read("reward", steps=[2])[0, :, S:], _shard_data(2, 1)["reward"])
    np.testing.assert_array_equal(store.complete_steps(), [0, 1, 2])


def test_reserve_and_mark_complete(tmp_path):
    store = _make(tmp_path / "traj")
    store.reserve(2)
    assert store.num_steps == 3
    store.reserve(0)  # never shrinks
    assert store.num_steps == 3
    assert store.to_dask("obs").shape == (3, T, B, 2, 5)
    assert store.complete_steps().tolist() == []
    _write_all(store.path, 1)
    store.mark_complete(1, weight_version=7, global_step=128, mean_return=0.5)
    assert store.complete_steps().tolist() == [1]
    assert store.complete_steps().dtype == np.int64
    assert store.step_scalar("weight_version").tolist() == [-1, 7, -1]
    assert store.step_scalar("global_step").dtype == np.int64
    ret = store.step_scalar("mean_return")
    assert ret[1] == 0.5 and np.isnan(ret[0]) and np.isnan(ret[2])
    store.reserve(4)  # per-step arrays grow with the fields
    assert store.step_scalar("weight_version").tolist() == [-1, 7, -1, -1, -1]
    _write_all(store.path, 4)
    store.mark_complete(4, weight_version=8)
    assert store.complete_steps().tolist() == [1, 4]
    with pytest.raises(ValueError, match="reserve"):
        store.mark_complete(5)
    _write_all(store.path, 3)
    with pytest.raises(ValueError, match="does not fit"):
        store.mark_complete(3, weight_version=1.5)
    text = describe(store.path)
    assert "complete=2: 1, 4" in text and "obs" in text and "[5, 4, 6, 2, 5] float32" in text
    assert "weight_version" in text and "PickCube-v1" in text


def test_create_on_existing_identical_reopens_with_data(tmp_path):
    path = tmp_path / "traj"
    store = _make(path)
    store.reserve(0)
    _write_all(path, 0)
    store.mark_complete(0, weight_version=3)
    created_at = store.attrs["created_at"]
    again = TrajectoryStore.create(path, fields=dict(FIELDS), T=T, num_envs=B, shard_size=S,
                                   attrs={**ATTRS, "resumed_from": 0})
    assert again.num_steps == 1
    assert again.complete_steps().tolist() == [0]
    assert again.attrs["created_at"] == created_at
    assert again.attrs["resumed_from"] == 0
    np.testing.assert_array_equal(again.read("action")[0, :, S:], _shard_data(0, 1)["action"])


def test_schema_and_layout_mismatch_errors(tmp_path):
    path = tmp_path / "traj"
    _make(path)
    other = {**FIELDS, "obs": FieldSpec(shape=(3, 5), dtype="float32")}
    with pytest.raises(ValueError, match=r"different layout.*field 'obs'.*new run directory") as e:
        TrajectoryStore.create(path, fields=other, T=T, num_envs=B, shard_size=S, attrs=ATTRS)
    assert str(path) in str(e.value)
    with pytest.raises(ValueError, match="T: stored 4, asked 5"):
        TrajectoryStore.create(path, fields=FIELDS, T=5, num_envs=B, shard_size=S, attrs=ATTRS)
    # bump the stored schema version: open must refuse, naming the path
    meta = path / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["schema_version"] = SCHEMA_VERSION + 1
    meta.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="schema_version 3") as e:
        TrajectoryStore.open(path)
    assert str(path) in str(e.value)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        TrajectoryStore.open(tmp_path / "nowhere")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a dagrl trajectory store"):
        TrajectoryStore.open(tmp_path / "plain")


def test_create_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="not a multiple of shard_size"):
        TrajectoryStore.create(tmp_path / "a", fields=FIELDS, T=T, num_envs=7, shard_size=3, attrs={})
    with pytest.raises(ValueError, match="'seeds' is not JSON-serialisable"):
        TrajectoryStore.create(tmp_path / "b", fields=FIELDS, T=T, num_envs=B, shard_size=S,
                               attrs={"seeds": np.arange(3)})
    with pytest.raises(ValueError, match="reserved"):
        TrajectoryStore.create(tmp_path / "c", fields=FIELDS, T=T, num_envs=B, shard_size=S,
                               attrs={"schema_version": 9})
    with pytest.raises(ValueError, match="dtype"):
        FieldSpec(shape=(1,), dtype="not-a-dtype")


def test_write_shard_validation(tmp_path):
    path = str(tmp_path / "traj")
    store = _make(path)
    with pytest.raises(ValueError, match="reserve"):
        write_shard(path, step=0, shard=0, data=_shard_data(0, 0))
    store.reserve(0)
    good = _shard_data(0, 0)
    with pytest.raises(ValueError, match=r"field 'action': expected dtype float32, got float64"):
        write_shard(path, step=0, shard=0, data={**good, "action": good["action"].astype(np.float64)})
    with pytest.raises(ValueError, match=r"field 'obs': expected shape \(4, 3, 2, 5\).*got \(4, 6, 2, 5\)"):
        write_shard(path, step=0, shard=0, data={**good, "obs": np.zeros((T, B, 2, 5), np.float32)})
    with pytest.raises(ValueError, match=r"missing fields \['reward'\]"):
        write_shard(path, step=0, shard=0, data={k: v for k, v in good.items() if k != "reward"})
    with pytest.raises(ValueError, match="shard 2 out of range"):
        write_shard(path, step=0, shard=2, data=good)
    # nothing was written by the failed calls
    assert not store.read("obs").any()


def _rewrite(path, step, shard, scale):
    data = {k: (v * scale if v.dtype != bool else v) for k, v in _shard_data(step, shard).items()}
    write_shard(str(path), step=step, shard=shard, data=data)
    return data


def test_redone_step_is_complete_only_when_every_shard_of_the_latest_attempt_is_written(tmp_path):
    """Issue 9 item 4: reserve(0) after mark_complete(0), then only shard 0 rewritten: step 0 is NOT complete
    (shard 0 new, shard 1 old), and cannot be marked complete until shard 1 writes the new attempt too."""
    path = tmp_path / "traj"
    store = _make(path)
    clear_cache()
    assert store.reserve(0) == 1
    _write_all(path, 0)
    store.mark_complete(0)
    assert store.complete_steps().tolist() == [0]
    assert store.reserve(0) == 2  # the step is redone
    assert store.complete_steps().tolist() == []  # cleared at once, before any shard writes
    new0 = _rewrite(path, 0, 0, 2.0)
    assert store.shards_written(0).tolist() == [True, False]
    assert store.complete_steps().tolist() == []
    with pytest.raises(ValueError, match=r"shard\(s\) \[1\] have not written its latest attempt 2"):
        store.mark_complete(0)
    assert TrajectoryStore.open(path).complete_steps().tolist() == []  # a reader in another process: same
    new1 = _rewrite(path, 0, 1, 3.0)
    store.mark_complete(0)
    assert store.complete_steps().tolist() == [0]
    got = store.read("reward", steps=[0])[0]
    np.testing.assert_array_equal(got[:, :S], new0["reward"])
    np.testing.assert_array_equal(got[:, S:], new1["reward"])


def test_a_stale_write_of_an_older_attempt_does_not_count(tmp_path):
    path = tmp_path / "traj"
    store = _make(path)
    clear_cache()
    first = store.reserve(0)
    second = store.reserve(0)  # a retry began before the first attempt's shards wrote
    _write_all(path, 0, attempt=first)
    assert store.shards_written(0).tolist() == [False, False]
    with pytest.raises(ValueError, match="latest attempt 2"):
        store.mark_complete(0)
    _write_all(path, 0, attempt=second)
    store.mark_complete(0)
    assert store.complete_steps().tolist() == [0]


@pytest.mark.parametrize("restored_step, left", [(0, []), (1, [0]), (2, [0, 1]), (3, [0, 1, 2]), (9, [0, 1, 2])])
def test_invalidate_from_drops_the_steps_after_the_restored_step(tmp_path, restored_step, left):
    """A rollback/resume to step k (k steps done: steps 0..k-1) leaves only steps < k complete."""
    path = tmp_path / "traj"
    store = _make(path)
    clear_cache()
    for e in range(3):
        store.reserve(e)
        _write_all(path, e)
        store.mark_complete(e)
    dropped = store.invalidate_from(restored_step)
    assert dropped == [e for e in range(3) if e >= restored_step]
    assert store.complete_steps().tolist() == left
    for e in range(restored_step, 3):  # redoing them shows them again, once
        store.reserve(e)
        _write_all(path, e)
        store.mark_complete(e)
    assert store.complete_steps().tolist() == [0, 1, 2]


def _refused_then_upgraded(path, capsys=None):
    """The store at `path` is refused by today's reader in one line naming it and the upgrade command (the store
    itself: it is no run's); `python -m pipelines.upgrade` rewrites it (0) and a second upgrade finds nothing."""
    from pipelines.upgrade import main as upgrade_main
    from storage.trajectories import OldStore
    clear_cache()
    with pytest.raises(OldStore) as exc:
        TrajectoryStore.open(path)
    msg = str(exc.value)
    assert "\n" not in msg and f"trajectory store {path} is of an older format" in msg
    assert f"`python -m pipelines.upgrade {path}`" in msg
    assert upgrade_main([str(path)]) == 0
    assert upgrade_main([str(path)]) == 0  # once: nothing left to do
    clear_cache()
    return msg


def test_a_store_written_before_attempts_existed_is_refused_then_upgraded(tmp_path, capsys):
    """Attempt arrays and store_id dropped (what dagrl wrote before them): refused; upgraded, today's reader shows
    the same complete steps and data, every allocated step at attempt 1 (its one reservation) with every shard on
    it, and a redo of a step is attempt 2, as the writer would have it."""
    import zarr
    path = tmp_path / "traj"
    store = _make(path)
    clear_cache()
    store.reserve(0)
    _write_all(path, 0)
    store.mark_complete(0)
    store.reserve(1)
    write_shard(str(path), step=1, shard=0, data=_shard_data(1, 0))  # step 1: half written, never complete
    g = zarr.open_group(str(path), mode="r+")
    created = g.attrs["created_at"]
    for name in ("attempt", "shard_attempt"):
        del g["steps"][name]
    del g.attrs["store_id"]
    msg = _refused_then_upgraded(path)
    assert "no steps/attempt array" in msg and "no store_id attribute" in msg
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and str(path) in out[0] and "nothing to do" in out[1]  # one line per rewritten file
    new = TrajectoryStore.open(path)
    assert new.complete_steps().tolist() == [0] and new.num_steps == 2
    assert [new.attempt(0), new.attempt(1)] == [1, 1]
    assert new.shards_written(0).tolist() == [True, True] and new.shards_written(1).tolist() == [True, False]
    assert new.attrs["store_id"] and new.attrs["created_at"] == created
    assert {k: new.attrs[k] for k in ATTRS} == ATTRS
    for s in range(B // S):
        np.testing.assert_array_equal(new.read("obs", [0])[0, :, s * S:(s + 1) * S], _shard_data(0, s)["obs"])
    assert new.reserve(0) == 2 and new.complete_steps().tolist() == []
    (backup,) = [p for p in tmp_path.glob("traj.upgrade-backup-*") if p.is_dir()]  # the old store, whole, beside it
    assert json.loads(backup.with_name(backup.name + ".json").read_text())["store"] == [
        "no steps/attempt array", "no steps/shard_attempt array", "no store_id attribute", "no simulator attribute",
        "no gripper_convention attribute", "no task_id field", "no trial_id field"]  # and what was old
    assert not (backup / "steps" / "attempt").exists() and (backup / "fields" / "obs" / "zarr.json").is_file()


def _write_v1_store(path, steps_written=(0, 1), complete=(0,), fields=FIELDS):
    """A store in the schema-1 layout, array by array as dagrl wrote it before the rename (group ``epochs``,
    ``schema_version`` 1; reference: storage/trajectories.py at commit 65245dd): shard data of each step in
    `steps_written`, shard_attempt = attempt = 1 there, ``complete`` set for `complete`."""
    import zarr
    g = zarr.open_group(str(path), mode="w-")
    g.attrs.update({"schema_version": 1, "created_at": "2026-11-30T00:00:00+00:00",
                    "layout": {"T": T, "num_envs": B, "shard_size": S,
                               "fields": {n: f.to_json() for n, f in sorted(fields.items())}}, **ATTRS})
    E, cfg = max(steps_written) + 1, {"write_empty_chunks": True}
    fg = g.create_group("fields")
    for name, spec in fields.items():
        arr = fg.create_array(name, shape=(E, T, B, *spec.shape), chunks=(1, T, S, *spec.shape), dtype=spec.dtype,
                              fill_value=False if spec.dtype == "bool" else 0, config=cfg)
        for e in steps_written:
            for s in range(B // S):
                arr[e, :, s * S:(s + 1) * S] = _shard_data(e, s, fields)[name]
    eg = g.create_group("epochs")
    done = eg.create_array("complete", shape=(E,), chunks=(1024,), dtype="bool", fill_value=False)
    att = eg.create_array("attempt", shape=(E,), chunks=(1024,), dtype="int64", fill_value=0)
    sha = eg.create_array("shard_attempt", shape=(E, B // S), chunks=(1, 1), dtype="int64", fill_value=-1, config=cfg)
    wv = eg.create_array("weight_version", shape=(E,), chunks=(1024,), dtype="int64", fill_value=-1)
    for e in steps_written:
        att[e], sha[e] = 1, 1
    for e in complete:
        done[e], wv[e] = True, 10 + e


def test_a_schema_1_store_is_refused_then_upgraded_with_its_steps(tmp_path):
    path = tmp_path / "v1"
    _write_v1_store(path)
    assert "schema version 1" in _refused_then_upgraded(path)
    new = TrajectoryStore.open(path)
    assert new.attrs["schema_version"] == SCHEMA_VERSION and new.num_steps == 2
    assert new.attrs["created_at"] == "2026-11-30T00:00:00+00:00" and new.attrs["store_id"]
    assert new.complete_steps().tolist() == [0]  # step 1 written but never marked complete
    assert new.step_scalar_names == ["weight_version"]
    assert new.step_scalar("weight_version").tolist() == [10, -1]
    for e in (0, 1):
        for name in FIELDS:
            np.testing.assert_array_equal(new.read(name, steps=[e])[0, :, S:], _shard_data(e, 1)[name])
    assert "steps allocated=2 complete=1: 0" in describe(path)
    import zarr
    assert sorted(zarr.open_group(str(path), mode="r").group_keys()) == ["fields", "steps"]
    # a resumed run redoes step 1 (its second attempt) and adds step 2, in today's layout
    for e in (1, 2):
        assert new.reserve(e) == (2 if e == 1 else 1)
        for s in range(B // S):
            write_shard(str(path), step=e, shard=s, data={**_shard_data(e, s), **{
                f: np.full((T, S), v, np.int64) for f, v in (("task_id", 0), ("trial_id", -1))}})
        new.mark_complete(e, weight_version=20 + e)
    assert TrajectoryStore.open(path).complete_steps().tolist() == [0, 1, 2]
    assert new.step_scalar("weight_version").tolist() == [10, 21, 22]


def test_a_new_store_is_schema_2_with_a_steps_group(tmp_path):
    import zarr
    store = _make(tmp_path / "v2")
    store.reserve(0)
    g = zarr.open_group(str(tmp_path / "v2"), mode="r")
    assert g.attrs["schema_version"] == 2
    assert sorted(g.group_keys()) == ["fields", "steps"]
    assert sorted(g["steps"].array_keys()) == ["attempt", "complete", "shard_attempt"]


def test_replay_and_sft_readers_refuse_a_schema_1_store_then_read_it_upgraded(tmp_path):
    from pipelines import replay
    from pipelines.replay_input import ReplayInputError
    from pipelines.upgrade import main as upgrade_main
    from tasks.demos import sft_index
    C = 2
    fields = {"obs": FieldSpec((3,), "float32"), "actions": FieldSpec((C, 2), "float32"),
              "rewards": FieldSpec((C,), "float32"), "step_mask": FieldSpec((C,), "bool"),
              "terminated": FieldSpec((), "bool"), "truncated": FieldSpec((), "bool"),
              "success": FieldSpec((), "bool"), "episode_seed": FieldSpec((), "int64"),
              "episode_id": FieldSpec((), "int64")}
    path = tmp_path / "v1"
    _write_v1_store(path, steps_written=(0, 1, 2), complete=(0, 2), fields=fields)
    import zarr
    zarr.open_group(str(path), mode="r+").attrs.update({"obs_mode": "state", "control_mode": "pd_ee_delta_pos",
                                                        "reward_mode": "normalized_dense"})  # what replay rebuilds from
    with pytest.raises(ReplayInputError, match=rf"older format .*`python -m pipelines.upgrade {path}`"):
        replay.open_store(path)
    with pytest.raises(ValueError, match="older format"):
        sft_index(str(path), only_success=False)
    assert upgrade_main([str(path)]) == 0
    store = replay.open_store(path)  # the checks replay runs (its required fields) pass
    idx = replay.load_index(store)
    assert idx.steps.tolist() == [0, 2] and idx.contiguous[T] == False  # noqa: E712 (step 1 is missing)
    mask = np.stack([np.concatenate([_shard_data(e, s, fields)["step_mask"] for s in range(B // S)], axis=1)
                     for e in (0, 2)])  # [2, T, B, C]: the executed chunk steps of the complete steps
    rows = sft_index(str(path), only_success=False)
    expected = np.argwhere(mask.any(-1))
    expected[:, 0] = np.array([0, 2])[expected[:, 0]]
    np.testing.assert_array_equal(rows, expected)
