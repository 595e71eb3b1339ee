"""Issue 47 item 2: a run's training data has an identity. The data a run reads from outside its run dir
(`sft.store`, `policy.model_path`) is fingerprinted at the start (`RunState.inputs`, saved in every checkpoint)
and compared on resume: a store re-recorded at the same path is refused with one line naming `sft.store`, the
recorded and the found fingerprint, and the fix."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from storage.exports import directory_fingerprint, index_export
from storage.trajectories import FieldSpec, TrajectoryStore, clear_cache, write_shard


def _record(path: Path, seed: int, O: int = 35, D: int = 8) -> str:
    """A state-only recording for conf=smoke (PushCube: 35-D state, 8-D actions, C=1): 2 rounds of 4 envs."""
    T, B, S = 5, 4, 2
    fields = {"obs": FieldSpec((O,), "float32"), "actions": FieldSpec((1, D), "float32"),
              "rewards": FieldSpec((1,), "float32"), "step_mask": FieldSpec((1,), "bool"),
              "terminated": FieldSpec((), "bool"), "truncated": FieldSpec((), "bool"),
              "success": FieldSpec((), "bool"), "episode_id": FieldSpec((), "int64"),
              "episode_seed": FieldSpec((), "int64"), "task_id": FieldSpec((), "int64"),
              "trial_id": FieldSpec((), "int64")}
    # today's format, as `pipelines.record` writes it (simulator, gripper convention, task/trial ids)
    from pipelines.config import load_config
    from tasks.envs import gripper_convention, store_attrs
    env = load_config(["conf=smoke"])[0].env
    attrs = {"simulator": env.simulator, "gripper_convention": gripper_convention(env), **store_attrs(env)}
    st = TrajectoryStore.create(path, fields=fields, T=T, num_envs=B, shard_size=S, attrs=attrs)
    r = np.random.default_rng(seed)
    for n in range(2):
        st.reserve(n)
        for s in range(B // S):
            d = {k: np.zeros((T, S, *f.shape), f.dtype) for k, f in fields.items()}
            d["obs"][:] = r.standard_normal(d["obs"].shape)
            d["actions"][:] = r.uniform(-1, 1, d["actions"].shape)
            d["step_mask"][:] = True
            d["success"][-1] = d["truncated"][-1] = True
            d["episode_id"][:] = np.arange(S) + S * s + B * n
            write_shard(str(path), step=n, shard=s, data=d)
        st.mark_complete(n)
    clear_cache()
    return st.fingerprint()


def test_directory_fingerprint_follows_the_content(tmp_path):
    """A model dir: any file's content, a new file, or (with a dagrl index) the index change it; a copy keeps it.
    A file above 64 MiB is sampled: a change in a sampled block changes it."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(np.arange(1000, dtype=np.float32).tobytes())
    fp = directory_fingerprint(d)
    assert fp.startswith("files sha256 ") and "(2 files, " in fp
    shutil.copytree(d, tmp_path / "copy")
    assert directory_fingerprint(tmp_path / "copy") == fp
    (d / "model.safetensors").write_bytes(np.arange(1, 1001, dtype=np.float32).tobytes())  # retrained: same size
    assert directory_fingerprint(d) != fp
    index_export(d)
    indexed = directory_fingerprint(d)
    assert indexed.startswith("index dagrl_files.json sha256 ")
    (d / "config.json").write_text('{"a": 2}')
    index_export(d)
    assert directory_fingerprint(d) != indexed
    big = tmp_path / "big"
    big.mkdir()
    blob = np.zeros(65 << 20, np.uint8)
    (big / "w.bin").write_bytes(blob.tobytes())
    fp = directory_fingerprint(big)
    blob[(65 << 20) // 64 * 10] = 1  # in the 11th sampled block
    (big / "w.bin").write_bytes(blob.tobytes())
    assert directory_fingerprint(big) != fp
    with pytest.raises(FileNotFoundError):
        directory_fingerprint(tmp_path / "none")


def test_resume_compares_the_recorded_fingerprints(tmp_path):
    """`_check_inputs` (resolve_resume): the same data passes (a key the run did not read before is recorded from
    now on); other weights at policy.model_path are refused naming the key, both fingerprints and the fix. (A
    checkpoint written before fingerprints were recorded is refused before this: tests/pipelines/test_upgrade.py.)"""
    from pipelines.runner.setup import RunState, _check_inputs, input_fingerprints
    from tasks.config import Config, ConfigError, replace_key
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "w.bin").write_bytes(b"\x01" * 100)
    cfg = replace_key(Config(), "policy.model_path", str(hf))
    now = input_fingerprints(cfg)
    assert list(now) == ["policy.model_path"]
    assert _check_inputs(cfg, RunState(run_id="r", inputs=dict(now))) == now
    assert _check_inputs(cfg, RunState(run_id="r")) == now  # recorded none: today's recorded from now on
    (hf / "w.bin").write_bytes(b"\x02" * 100)
    with pytest.raises(ConfigError) as err:
        _check_inputs(cfg, RunState(run_id="r", step=3, inputs=dict(now)))
    msg = str(err.value)
    assert err.value.key == "policy.model_path" and "\n" not in msg
    assert f"recorded: {now['policy.model_path']}" in msg and f"found: {directory_fingerprint(hf)}" in msg
    assert "start a new run" in msg


@pytest.mark.slow
def test_a_re_recorded_sft_store_is_refused_on_resume(tmp_path, capsys):
    """A tiny real SFT run (conf=smoke's PushCube env, the MLP policy, 1 step, a checkpoint), then the store is
    re-recorded at the same path: the resume is one line naming sft.store and both fingerprints, exit 2, before any
    cluster starts; the original recording put back resumes (its fingerprint is the recorded one)."""
    from pipelines.config import load_config
    from pipelines.run import main as run_main
    from pipelines.runner.setup import resolve_resume
    store = tmp_path / "demos.zarr"
    first = _record(store, seed=0)
    args = ["conf=smoke", "algorithm.name=sft", f"sft.store={store}", "sft.only_success=false",
            "runner.save_interval=1", "runner.val_check_interval=1", f"run_root={tmp_path / 'runs'}"]
    assert run_main([*args, "runner.max_steps=1"]) == 0
    (run_id,) = [p.name for p in (tmp_path / "runs" / "smoke").iterdir() if p.is_dir()]
    shutil.move(store, tmp_path / "original.zarr")
    second = _record(store, seed=0)  # the same recipe and seed, recorded again: another recording
    assert second != first
    capsys.readouterr()
    assert run_main([*args, "runner.max_steps=2", f"runner.resume={run_id}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: sft.store='{store}': holds other data than run {run_id} trained on until step 1")
    assert f"recorded: {first}" in err and f"found: {second}" in err and "start a new run" in err
    shutil.rmtree(store)
    shutil.move(tmp_path / "original.zarr", store)
    cfg, _ = load_config([*args, "runner.max_steps=2", f"runner.resume={run_id}"])
    res = resolve_resume(cfg)
    assert res.state.step == 1 and res.state.inputs == {"sft.store": first}
    clear_cache()
