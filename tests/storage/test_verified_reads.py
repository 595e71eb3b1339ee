"""Issue 47 item 2: every reader of a trajectory store reads through the store's one verified read
(`TrajectoryStore.read` / `gather` / `to_dask`): a chunk file removed from a complete step is a `DamagedStore`
naming the store, the field and the chunk file, never the fill value (zeros) read as data. And an undamaged store
loads exactly the samples a plain zarr read gives.

Stores are built through the store's own write path (`TrajectoryStore.create`, `write_shard`, `mark_complete`);
no simulator, no cluster.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import zarr

from storage import episodes
from storage.trajectories import DamagedStore, FieldSpec, TrajectoryStore, clear_cache, write_shard
from tasks import resident
from tasks.config import Config, replace_keys
from tasks.demo_index import sft_fields, sft_index
from tasks.demos import set_demo_stats, sft_load

T, B, S, N, C, D, O, H = 3, 4, 2, 2, 2, 3, 5, 4  # chunk steps, envs, shard size, steps, chunk, action, obs, image
FIELDS = {"obs": FieldSpec((O,), "float32"), "rgb": FieldSpec((H, H, 3), "uint8"),
          "actions": FieldSpec((C, D), "float32"), "rewards": FieldSpec((C,), "float32"),
          "step_mask": FieldSpec((C,), "bool"), "terminated": FieldSpec((), "bool"),
          "truncated": FieldSpec((), "bool"), "success": FieldSpec((), "bool"),
          "episode_id": FieldSpec((), "int64"), "episode_seed": FieldSpec((), "int64"),
          "task_id": FieldSpec((), "int64"), "trial_id": FieldSpec((), "int64")}
ATTRS = {"simulator": "maniskill", "gripper_convention": "open_positive"}  # what a recording of ManiSkill writes


def _data(n: int, s: int) -> dict[str, np.ndarray]:
    """Shard s of recording round n: one episode per env (id g + n * B), every action executed, success at the
    last chunk step for even envs, random non-zero obs / actions / rewards / images."""
    r = np.random.default_rng(10 * n + s)
    g = np.arange(s * S, (s + 1) * S)
    d = {k: np.zeros((T, S, *f.shape), f.dtype) for k, f in FIELDS.items()}
    d["obs"][:] = r.uniform(1, 2, d["obs"].shape)
    d["rgb"][:] = r.integers(1, 255, d["rgb"].shape)
    d["actions"][:] = r.uniform(0.1, 1, d["actions"].shape)
    d["rewards"][:] = r.uniform(0.1, 1, d["rewards"].shape)
    d["step_mask"][:] = True
    d["success"][-1] = g % 2 == 0
    d["truncated"][-1] = True
    d["episode_id"][:] = g + n * B
    d["episode_seed"][:] = 100 + g + n * B
    d["task_id"][:], d["trial_id"][:] = 0, -1  # ManiSkill's one task, no trials
    return d


def _record(path) -> None:
    """A complete store at `path`: N steps of `_data`, every shard written, every step marked complete."""
    st = TrajectoryStore.create(path, fields=FIELDS, T=T, num_envs=B, shard_size=S, attrs=ATTRS)
    for n in range(N):
        st.reserve(n)
        for s in range(B // S):
            write_shard(str(path), step=n, shard=s, data=_data(n, s))
        st.mark_complete(n)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One `_record` store for the module; each test damages its own copy (`store`)."""
    path = tmp_path_factory.mktemp("recorded") / "demos.zarr"
    _record(path)
    return path


@pytest.fixture()
def store(tmp_path, recorded):
    """A copy of the module's recorded store, file for file (what `_record` writes at any path: the store
    keeps no absolute path)."""
    path = tmp_path / "demos.zarr"
    shutil.copytree(recorded, path)
    resident.release("sft_data/")
    yield path
    resident.release("sft_data/")
    clear_cache()


def _remove_chunk(path, field: str, step: int = 1, shard: int = 1) -> str:
    """Delete the chunk file of (step, shard) of `field`; returns its key relative to the field's array."""
    arr = zarr.open_array(str(path / "fields" / field), mode="r")
    key = arr.metadata.encode_chunk_key((step, 0, shard) + (0,) * (arr.ndim - 3))
    (path / "fields" / field / key).unlink()
    return key


def _cfg(path, value: bool = False) -> Config:
    return replace_keys(Config(), {"sft.store": str(path), "sft.batch_size": 8, "sft.only_success": True,
                                   "sft.value_coef": 1.0 if value else 0.0})


def _sft_samples(path, value=False):
    return sft_load(_cfg(path, value), seed=0, num_batches=1)


def _flow_stats(path):
    """set_demo_stats of the tiny token VLA with normalize_state (its action q01 / q99 and the state statistics):
    reads obs, actions, step_mask (and the index fields) of the behaviour-cloning samples."""
    from tasks.config import family_class
    from tasks.policies import make_policy
    p = family_class("policy", "token_vla")(preset="tiny", num_action_chunks=C, max_prompt_len=8,
                                            normalize_state=True)
    cfg = replace_keys(_cfg(path), {"env.obs_mode": "state", "algorithm.name": "sft", "policy": p})
    assert set_demo_stats(cfg, make_policy(p, obs_dim=O, action_dim=D, seed=0))


def _replay_index(path):
    st = TrajectoryStore.open(path)
    idx = episodes.load_index(st)
    eps = episodes.find_episodes(idx)
    episodes.stored_outcomes(st, idx, eps)
    for ep in eps.values():
        episodes.read_episode_data(st, idx, ep)


# reader -> the fields it reads (each is damaged in turn below)
READERS = {
    "sft_index": (lambda p: sft_index(str(p), only_success=True), ("step_mask", "episode_id", "success")),
    "sft samples": (_sft_samples, sft_fields(FIELDS, only_success=True, value=False)),
    "sft value warm start": (lambda p: _sft_samples(p, value=True), sft_fields(FIELDS, only_success=True,
                                                                              value=True)),
    "set_demo_stats": (_flow_stats, ("step_mask", "episode_id", "success", "obs", "actions")),
    "replay episode index": (_replay_index, (*episodes.INDEX_FIELDS, "obs", "actions", "rewards")),
    "TrajectoryStore.read": (lambda p: [TrajectoryStore.open(p).read(f) for f in FIELDS], tuple(FIELDS)),
    "TrajectoryStore.to_dask": (lambda p: [TrajectoryStore.open(p).to_dask(f) for f in FIELDS], tuple(FIELDS)),
}
CASES = [(reader, field) for reader, (_, fields) in READERS.items() for field in fields]


def test_the_readers_read_the_fields_listed_here():
    """The field lists above are what the readers need: the SFT ones are `sft_fields` (what pipelines.config
    checks before a run), each covering obs/actions and the index; a store missing a field the reader reads
    fails with KeyError naming it (so a list that left a field out would not be caught by the damage cases)."""
    assert set(READERS["sft samples"][1]) == {"step_mask", "episode_id", "success", "obs", "rgb", "actions",
                                             "task_id"}
    assert set(READERS["sft value warm start"][1]) - set(READERS["sft samples"][1]) == {"rewards", "truncated"}


@pytest.mark.parametrize("reader, field", CASES, ids=[f"{r}-{f}" for r, f in CASES])
def test_a_missing_chunk_of_each_field_a_reader_reads_is_damage_naming_the_field(store, reader, field):
    key = _remove_chunk(store, field)
    with pytest.raises(DamagedStore) as err:
        READERS[reader][0](store)
    msg = str(err.value)
    assert "\n" not in msg and str(store) in msg and f"fields/{field} chunk file {key} (step 1, envs 2-3)" in msg
    assert "is missing" in msg and "re-record it" in msg


def test_a_garbled_chunk_is_damage_naming_the_chunk_file(store):
    key = _remove_chunk(store, "actions", step=0, shard=0)
    (store / "fields" / "actions" / key).parent.mkdir(parents=True, exist_ok=True)
    (store / "fields" / "actions" / key).write_bytes(b"\x28\xb5\x2f\xfd not a zstd frame")
    with pytest.raises(DamagedStore, match=rf"fields/actions chunk file {key} \(step 0, envs 0-1\) cannot be "
                                           rf"decoded"):
        _sft_samples(store)


@pytest.mark.parametrize("field", ["actions", "obs", "rewards"])
def test_a_flipped_bit_in_a_chunk_is_damage_not_a_changed_value(store, field):
    """Field chunks carry zstd's content checksum: one bit flipped in the middle of a chunk file (its frame still
    well formed) is a decode error naming the chunk, never a value read back changed."""
    arr = zarr.open_array(str(store / "fields" / field), mode="r")
    key = arr.metadata.encode_chunk_key((1, 0, 1) + (0,) * (arr.ndim - 3))
    f = store / "fields" / field / key
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    st = TrajectoryStore.open(store)
    with pytest.raises(DamagedStore, match=rf"fields/{field} chunk file {key} \(step 1, envs 2-3\) cannot be decoded"):
        st.read(field, [1])
    clear_cache()


def test_reads_of_steps_not_written_stay_fill_values_and_explicit_steps_are_checked(tmp_path):
    """A reserved step no shard wrote is not complete: `read(field)` returns its fill values (nothing vouched for);
    asking for it by number checks its chunk files like any other step."""
    path = tmp_path / "s.zarr"
    st = TrajectoryStore.create(path, fields=FIELDS, T=T, num_envs=B, shard_size=S)
    st.reserve(0)
    assert not st.read("obs").any() and st.read("obs").shape == (1, T, B, O)
    with pytest.raises(DamagedStore, match=r"fields/obs chunk file \S+ \(step 0, envs 0-1\) is missing"):
        st.read("obs", [0])
    clear_cache()


def test_an_undamaged_store_loads_exactly_what_a_plain_zarr_read_gives(store):
    """The verified path returns the same samples as reading the zarr arrays directly (the unverified read it
    replaced): the SFT samples of the selected rows, field by field, and `read` / `gather` of every field."""
    raw = {f: zarr.open_array(str(store / "fields" / f), mode="r")[:] for f in FIELDS}
    # the selected rows by the definition: executed chunk steps of episodes successful at some chunk step
    good = np.unique(raw["episode_id"][raw["success"] & raw["step_mask"].any(-1)])
    rows = np.argwhere(raw["step_mask"].any(-1) & np.isin(raw["episode_id"], good))
    np.testing.assert_array_equal(sft_index(str(store), only_success=True), rows)
    assert len(rows) == N * T * (B // 2)  # even envs succeed
    st = TrajectoryStore.open(store)
    for f in FIELDS:
        np.testing.assert_array_equal(st.read(f), raw[f])
        np.testing.assert_array_equal(st.read(f, [1, 0]), raw[f][[1, 0]])
        np.testing.assert_array_equal(st.gather(f, rows), raw[f][rows[:, 0], rows[:, 1], rows[:, 2]])
    from tasks.demos import _dataset
    data = _dataset(_cfg(store))
    for f in ("obs", "rgb", "actions", "task_id"):
        np.testing.assert_array_equal(data[f], raw[f][rows[:, 0], rows[:, 1], rows[:, 2]])
    assert (np.abs(data["actions"]) > 0).all()  # no fill value among the samples


def test_a_damaged_sft_store_is_refused_by_the_config_check_for_every_field_the_run_reads(tmp_path):
    """pipelines.config's sft.store check stats the chunk files of `sft_fields` (all the run's data workers read),
    so a store missing an `actions` chunk (the issue's input) is one ConfigError line before anything starts."""
    from pipelines.config import check_sft_store
    from tasks.config import ConfigError
    for i, field in enumerate(sft_fields(FIELDS, only_success=True, value=True)):
        path = tmp_path / f"d{i}.zarr"
        _record(path)
        key = _remove_chunk(path, field)
        cfg = replace_keys(_cfg(path, value=True), {"algorithm.name": "sft", "policy.num_action_chunks": C,
                                                    "env.obs_mode": "state"})
        with pytest.raises(ConfigError, match=rf"fields/{field} chunk file {key} \(step 1, envs 2-3\) is missing"
                                              rf".*re-record it") as err:
            check_sft_store(cfg)
        assert err.value.key == "sft.store" and "\n" not in str(err.value)
        clear_cache()


def test_fingerprint_tells_recordings_apart_and_ignores_copies(store, tmp_path):
    """Same files (a copy elsewhere): same fingerprint; the same data re-recorded at the same path (a new store
    id), a step redone or a step invalidated: another fingerprint. Reads no field data."""
    import shutil
    st = TrajectoryStore.open(store)
    fp = st.fingerprint()
    assert fp.startswith(f"store {st.attrs['store_id'][:12]} ") and f"{N} complete steps" in fp
    shutil.copytree(store, tmp_path / "copy.zarr")
    assert TrajectoryStore.open(tmp_path / "copy.zarr").fingerprint() == fp
    for f in FIELDS:  # field data is not part of it: removing every chunk leaves it unchanged
        shutil.rmtree(store / "fields" / f / "c")
    assert TrajectoryStore.open(store).fingerprint() == fp
    shutil.rmtree(store)
    again = TrajectoryStore.create(store, fields=FIELDS, T=T, num_envs=B, shard_size=S)
    for n in range(N):
        again.reserve(n)
        for s in range(B // S):
            write_shard(str(store), step=n, shard=s, data=_data(n, s))
        again.mark_complete(n)
    second = again.fingerprint()
    assert second != fp and f"{N} complete steps" in second
    again.reserve(1)  # redone: not complete until rewritten, then a new attempt
    assert f"{N - 1} complete steps" in again.fingerprint()
    for s in range(B // S):
        write_shard(str(store), step=1, shard=s, data=_data(1, s))
    again.mark_complete(1)
    assert again.fingerprint() not in (fp, second)


@pytest.mark.parametrize("damage", ["cut at a line", "emptied", "a value changed"])
def test_a_damaged_saved_config_is_refused_not_read_as_defaults(tmp_path, damage):
    """A run's config.yaml is written with its sha256 beside it; a copy cut at a line boundary (still valid YAML: the
    missing keys would come back as the schema's defaults), emptied, or with one value changed is refused by the one
    verified read (`read_resolved_config`, and `pipelines.config.read_saved_config` / `load_saved_config` as a
    one-line ConfigError naming the file); the file as written reads back unchanged."""
    import yaml
    from omegaconf import OmegaConf

    from pipelines.config import load_config, load_saved_config, read_saved_config, to_yaml
    from storage.rundir import DamagedRunFile, read_resolved_config, write_resolved_config
    from tasks.config import ConfigError
    text = to_yaml(load_config(["conf=smoke"], components=False)[0])  # what a run saves: its typed config
    path = write_resolved_config(tmp_path, text)
    assert read_resolved_config(path) == text
    assert OmegaConf.to_container(read_saved_config(path)) == yaml.safe_load(text)
    lines = text.splitlines(keepends=True)
    path.write_text({"cut at a line": "".join(lines[: len(lines) // 2]), "emptied": "",
                     "a value changed": text.replace("max_steps: ", "max_steps: 1", 1)}[damage])
    with pytest.raises(DamagedRunFile, match=r"config\.yaml is (damaged|empty)"):
        read_resolved_config(path)
    with pytest.raises(ConfigError, match=r"config\.yaml is (damaged|empty).*restore it"):
        load_saved_config(path)


def test_a_saved_config_without_a_digest_is_refused_naming_the_upgrade(tmp_path):
    """Runs saved before the digest existed have config.yaml alone: it cannot be verified, so it is refused (one
    line naming the file and `python -m pipelines.upgrade RUN_DIR`, which writes the digest), by the one verified
    read and by the loader of saved configs; an empty one is refused as empty."""
    from pipelines.config import load_saved_config, to_yaml
    from storage.rundir import DamagedRunFile, OldRunFile, read_resolved_config
    from tasks.config import Config, ConfigError
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(Config()))
    with pytest.raises(OldRunFile) as exc:
        read_resolved_config(path)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and "config.yaml.sha256" in msg
    assert f"`python -m pipelines.upgrade {tmp_path}`" in msg
    with pytest.raises(ConfigError, match=r"older format.*python -m pipelines\.upgrade"):
        load_saved_config(path, validate=False)
    path.write_text("\n")
    with pytest.raises(DamagedRunFile, match="is empty"):
        read_resolved_config(path)
