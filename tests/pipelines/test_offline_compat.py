"""A demo store (`sft.store`) or a policy checkpoint (`policy.model_path`) made on another env than the configured
one is refused offline, by the one check path (`pipelines.validate`, `pipelines.run`, `pipelines.eval` of an hf
dir): exit 2, one line naming the key, the recorded and the configured value and the fix, nothing written.

Before, a PushCube store recorded with `pd_joint_delta_pos` (8-D actions) passed `validate` under
`env.control_mode=pd_ee_delta_pos` and the SFT run failed after creating its run dir and MLflow run
(`ValueError: actions (64, 5, 8): expected [N, 5, 4]`); a PushCube checkpoint passed under `env.env_id=PickCube-v1`.

The inputs are made here as the project makes them: a store with the attributes `pipelines.record` writes (env
keys of the recording conf, `gripper_convention`, `store_attrs`), and a tiny pi0 written by `save_pretrained`
with the `env` that `pipelines.graphs.export_env_meta` adds to a run's `hf/` export, inside a run directory
(`RUN/config.yaml`, `RUN/checkpoints/global_step_N/hf`, `RUN/checkpoints/best`) and copied out of it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.pipelines.test_config import _fake_sft_store

SFT = ["conf=pushcube_pi0_sft", "sft.only_success=false", "runner.max_steps=1",
       "policy.max_prompt_len=64"]  # the tester's command (PickCube's prompt is 51 byte-level tokens)
GRPO = "conf=pushcube_pi0_grpo"


@pytest.fixture(autouse=True)
def _cpu_only_machine(monkeypatch):
    """The expectations here are those of a CPU-only machine (as tests/pipelines/test_config.py)."""
    import pipelines.clusters.placement
    monkeypatch.setattr(pipelines.clusters.placement, "_cuda_device_count", lambda: 0)


def _refused(main, args, capsys) -> str:
    """Run a CLI `main(args)`; it must exit 2 with exactly one `error: ` line on stderr. Returns that line."""
    rc = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    return err[0]


@pytest.fixture
def no_cluster(monkeypatch):
    """A cluster start fails the test at once: the refusals below come before any worker starts."""
    import pipelines.clusters

    def start_cluster(cfg):
        raise AssertionError("a cluster was started: the config passed the offline checks")
    monkeypatch.setattr(pipelines.clusters, "start_cluster", start_cluster)


def _accepted(main, args, capsys) -> None:
    rc = main(args)
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()


# ----- sft.store -----

@pytest.fixture(scope="module")
def recorded_store(tmp_path_factory) -> Path:
    """A PushCube-v1 demo store recorded by conf=pushcube_record (pd_joint_delta_pos: 8-D actions, C=5, 32 px), with
    the env attributes pipelines.record writes."""
    from pipelines.config import load_config
    from storage.trajectories import TrajectoryStore
    from tasks.envs import gripper_convention, store_attrs
    rec = load_config(["conf=pushcube_record"], components=False, command="record")[0]
    assert (rec.env.env_id, rec.env.control_mode) == ("PushCube-v1", "pd_joint_delta_pos")
    path = _fake_sft_store(tmp_path_factory.mktemp("demos") / "pushcube_record.zarr",
                           C=rec.policy.num_action_chunks, image=rec.env.image_size)
    TrajectoryStore.open(path).update_attrs(
        env_id=rec.env.env_id, simulator=rec.env.simulator, obs_mode=rec.env.obs_mode,
        control_mode=rec.env.control_mode, reward_mode=rec.env.reward_mode,
        num_action_chunks=rec.policy.num_action_chunks, gripper_convention=gripper_convention(rec.env),
        **store_attrs(rec.env))
    return path


STORE_MISMATCHES = [
    (["env.control_mode=pd_ee_delta_pos"], {"control_mode": ("pd_joint_delta_pos", "pd_ee_delta_pos")}),
    (["env.env_id=PickCube-v1"], {"env_id": ("PushCube-v1", "PickCube-v1")}),
    (["env.env_id=PickCube-v1", "env.control_mode=pd_ee_delta_pos"],
     {"env_id": ("PushCube-v1", "PickCube-v1"), "control_mode": ("pd_joint_delta_pos", "pd_ee_delta_pos")}),
]


@pytest.mark.parametrize("overrides, diff", STORE_MISMATCHES, ids=[" ".join(o) for o, _ in STORE_MISMATCHES])
def test_a_store_recorded_on_another_env_is_refused_by_validate_naming_both_values_and_the_fix(
        recorded_store, overrides, diff, tmp_path, capsys):
    from pipelines import validate
    args = [*SFT, f"sft.store={recorded_store}", *overrides, f"run_root={tmp_path / 'runs'}"]
    line = _refused(validate.main, args, capsys)
    assert line.startswith(f"error: sft.store='{recorded_store}': was recorded with "), line
    for k, (stored, configured) in diff.items():
        assert f"env.{k}={stored}" in line and f"this config has" in line and f"env.{k}={configured}" in line, line
    fix = "set " + " ".join(f"env.{k}={stored}" for k, (stored, _) in diff.items())
    assert fix in line, line
    # the fix it names works: the same command with the store's env validates
    _accepted(validate.main, [*args, *(f"env.{k}={stored}" for k, (stored, _) in diff.items())], capsys)


def test_run_refuses_the_other_control_mode_before_writing_anything(recorded_store, tmp_path, capsys, monkeypatch,
                                                                   no_cluster):
    """The tester's `pipelines.run` command: refused with validate's line, no run dir, no MLflow store."""
    from pipelines import run, validate
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    args = [*SFT, f"sft.store={recorded_store}", "env.control_mode=pd_ee_delta_pos", f"run_root={root}"]
    line = _refused(run.main, args, capsys)
    assert "sft.store=" in line and "env.control_mode=pd_joint_delta_pos" in line, line
    assert not root.exists() and list(tmp_path.iterdir()) == []
    assert _refused(validate.main, args, capsys) == line


def test_a_libero_store_of_another_suite_is_refused(tmp_path, capsys):
    """A stored task_id indexes its suite's task table: libero_spatial demos under libero_object would be trained
    with libero_object's instructions."""
    from pipelines import validate
    from storage.trajectories import TrajectoryStore
    path = _fake_sft_store(tmp_path / "libero_spatial.zarr", gripper_convention="close_positive", obs_dim=14)
    TrajectoryStore.open(path).update_attrs(env_id="libero_spatial", simulator="libero", control_mode="OSC_POSE")
    args = ["conf=libero_pi0_sft", f"sft.store={path}", f"run_root={tmp_path / 'runs'}"]
    line = _refused(validate.main, [*args, "env.env_id=libero_object"], capsys)
    assert "was recorded with env.env_id=libero_spatial, this config has env.env_id=libero_object" in line, line
    assert "set env.env_id=libero_spatial" in line, line


# ----- policy.model_path -----

def _export(cfg, path: Path, *, obs_dim: int, action_dim: int) -> Path:
    """A tiny policy of `cfg` written as a run's checkpoint export is (tasks.actor.export.write_export, what
    actor_export calls: save_pretrained, config.json `env`, dagrl_files.json)."""
    import torch

    from pipelines.graphs import export_env_meta
    from tasks.policies import make_policy
    from tasks.rollout import image_size, num_values
    from tasks.actor.export import write_export
    torch.manual_seed(0)
    pol = make_policy(cfg.policy, obs_dim=obs_dim, action_dim=action_dim, num_values=num_values(cfg),
                      image_size=image_size(cfg), load=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(write_export(pol, path, export_env_meta(cfg)))


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, recorded_store) -> Path:
    """An SFT run directory of conf=pushcube_pi0_sft (PushCube-v1, pd_joint_delta_pos: 8-D actions) with its
    config.yaml, checkpoints/global_step_3/hf and checkpoints/best -> global_step_3."""
    from pipelines.config import load_config, to_yaml
    cfg = load_config(["conf=pushcube_pi0_sft", f"sft.store={recorded_store}"], components=False)[0]
    run = tmp_path_factory.mktemp("runs") / "pushcube_pi0_sft" / "20261204-000000-abcd"
    from storage.rundir import write_resolved_config
    write_resolved_config(run, to_yaml(cfg))
    _export(cfg, run / "checkpoints" / "global_step_3" / "hf", obs_dim=35, action_dim=8)
    (run / "checkpoints" / "best").symlink_to("global_step_3")
    return run


@pytest.fixture(scope="module")
def copied_hf(sft_run, tmp_path_factory) -> Path:
    """The run's export copied out of its run directory (config.json only: no run config.yaml above it)."""
    out = tmp_path_factory.mktemp("export") / "hf"
    shutil.copytree(sft_run / "checkpoints" / "global_step_3" / "hf", out)
    return out


def _model_paths(sft_run, copied_hf) -> list[Path]:
    return [sft_run / "checkpoints" / "global_step_3" / "hf", sft_run / "checkpoints" / "best" / "hf", copied_hf]


def test_a_checkpoint_of_another_env_task_is_refused_by_validate(sft_run, copied_hf, tmp_path, capsys):
    from pipelines import validate
    for hf in _model_paths(sft_run, copied_hf):
        args = [GRPO, f"policy.model_path={hf}", f"run_root={tmp_path / 'runs'}"]
        line = _refused(validate.main, [*args, "env.env_id=PickCube-v1"], capsys)
        assert line.startswith(f"error: policy.model_path='{hf}': was trained with env.env_id=PushCube-v1, "
                               f"this config has env.env_id=PickCube-v1"), line
        assert "set env.env_id=PushCube-v1" in line, line
        _accepted(validate.main, [*args, "env.env_id=PushCube-v1"], capsys)  # the fix works


def test_a_checkpoint_of_another_control_mode_is_refused_by_validate(sft_run, copied_hf, tmp_path, capsys):
    """The action length follows the control mode; a run's checkpoint names it in the run's config.yaml, and the
    hf/ export's config.json records it too (`export_env_meta`), so a copied-out export is checked as well."""
    from pipelines import validate
    for hf in _model_paths(sft_run, copied_hf):
        args = [GRPO, f"policy.model_path={hf}", f"run_root={tmp_path / 'runs'}"]
        line = _refused(validate.main, [*args, "env.control_mode=pd_ee_delta_pos"], capsys)
        assert line.startswith(f"error: policy.model_path='{hf}': was trained with "
                               f"env.control_mode=pd_joint_delta_pos, this config has "
                               f"env.control_mode=pd_ee_delta_pos"), line
        assert "set env.control_mode=pd_joint_delta_pos" in line, line


def test_eval_of_an_hf_dir_refuses_another_env_task_before_writing(copied_hf, tmp_path, capsys, monkeypatch,
                                                                    no_cluster):
    """`pipelines.eval HF conf=NAME` composes through the same check (pipelines.eval.eval_config)."""
    from pipelines import eval as ev
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    line = _refused(ev.main, [str(copied_hf), GRPO, "env.env_id=PickCube-v1", f"run_root={root}"], capsys)
    assert f"policy.model_path='{copied_hf}': was trained with env.env_id=PushCube-v1" in line, line
    assert not root.exists() and list(tmp_path.iterdir()) == []


def test_a_libero_checkpoint_of_another_action_length_is_refused_another_suite_is_not(tmp_path, capsys):
    """LIBERO's action length is known offline (tasks.envs.libero.adapter.ACTION_DIM: 7). Its suites share robot, state
    and actions: a checkpoint of one suite on another (libero_90 -> libero_10) is the papers' cross-suite use."""
    from pipelines import validate
    from pipelines.config import load_config
    from tasks.envs import state_dim
    from tasks.envs.libero.adapter import ACTION_DIM
    cfg = load_config(["conf=libero_smoke"], components=False)[0]
    hf = _export(cfg, tmp_path / "hf8", obs_dim=state_dim(cfg.env), action_dim=ACTION_DIM + 1)
    args = ["conf=libero_smoke", f"run_root={tmp_path / 'runs'}"]
    line = _refused(validate.main, [*args, f"policy.model_path={hf}"], capsys)
    assert f"outputs {ACTION_DIM + 1}-D actions, env.simulator=libero takes {ACTION_DIM}-D" in line, line
    hf = _export(cfg, tmp_path / "hf7", obs_dim=state_dim(cfg.env), action_dim=ACTION_DIM)
    assert validate.main([*args, f"policy.model_path={hf}", "env.env_id=libero_goal"]) == 0, capsys.readouterr()


def test_a_critic_warm_start_on_another_reward_is_refused_not_the_bc_alone(recorded_store, tmp_path, capsys):
    """With `sft.value_coef > 0` the value head is fitted to the store's rewards: a recording of another
    `reward_mode` would hand the RL run a critic on another scale. Behaviour cloning alone does not read rewards."""
    from pipelines import validate
    args = [*SFT, f"sft.store={recorded_store}", f"run_root={tmp_path / 'runs'}", "env.reward_mode=sparse"]
    line = _refused(validate.main, [*args, "sft.value_coef=1.0"], capsys)
    assert line.startswith(f"error: sft.store='{recorded_store}': stores rewards of env.reward_mode="
                           f"normalized_dense, this config has env.reward_mode=sparse"), line
    assert "sft.value_coef=0" in line, line
    _accepted(validate.main, [*args, "sft.value_coef=0"], capsys)


# ----- a damaged policy.model_path (hf/ export) -----

@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete"])
def test_a_damaged_export_is_refused_offline_naming_the_file(sft_run, tmp_path, capsys, monkeypatch, no_cluster,
                                                             damage):
    """An export's files are listed with size and sha256 in its dagrl_files.json (tasks.actor.export.write_export). A
    copy with one byte of its weights changed loaded silently (other weights, no error) and a truncated one failed
    on a worker after the run started; now validate, run and eval of the hf dir refuse it before writing anything,
    naming the file, and the intact export passes."""
    from pipelines import eval as ev
    from pipelines import run, validate
    hf = tmp_path / "copy" / "hf"
    shutil.copytree(sft_run / "checkpoints" / "global_step_3" / "hf", hf)
    args = [GRPO, f"policy.model_path={hf}", f"run_root={tmp_path / 'runs'}"]
    _accepted(validate.main, args, capsys)
    weights = hf / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip a byte":
        data[-5] ^= 0xFF  # in the tensor data: safetensors itself would load it without complaint
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    else:
        weights.unlink()
    monkeypatch.chdir(tmp_path)
    for main, argv in ((validate.main, args), (run.main, args), (ev.main, [str(hf), *args[:1], args[2]])):
        line = _refused(main, argv, capsys)
        assert line.startswith(f"error: policy.model_path='{hf}': is damaged: "), line
        assert "model.safetensors" in line and "export it again or use another checkpoint" in line, line
    assert not (tmp_path / "runs").exists()


def test_an_export_without_the_index_still_loads_and_the_index_covers_every_file(sft_run, tmp_path, capsys):
    """Exports written before dagrl_files.json (or by another tool) are accepted as before; the index lists every
    other file of the directory with its real size and sha256."""
    import hashlib

    from pipelines import validate
    from storage.exports import EXPORT_INDEX
    src = sft_run / "checkpoints" / "global_step_3" / "hf"
    index = json.loads((src / EXPORT_INDEX).read_text())["files"]
    on_disk = {p.name for p in src.iterdir() if p.name != EXPORT_INDEX}
    assert set(index) == on_disk and "model.safetensors" in on_disk
    for name, info in index.items():
        assert info == {"size": (src / name).stat().st_size,
                        "sha256": hashlib.sha256((src / name).read_bytes()).hexdigest()}
    old = tmp_path / "old" / "hf"
    shutil.copytree(src, old)
    (old / EXPORT_INDEX).unlink()
    _accepted(validate.main, [GRPO, f"policy.model_path={old}", f"run_root={tmp_path / 'runs'}"], capsys)


def test_an_unreadable_config_json_is_one_error_not_a_traceback(sft_run, tmp_path, capsys):
    from pipelines import validate
    from storage.exports import EXPORT_INDEX
    hf = tmp_path / "hf"
    shutil.copytree(sft_run / "checkpoints" / "global_step_3" / "hf", hf)
    (hf / EXPORT_INDEX).unlink()  # no index to catch it first
    (hf / "config.json").write_text("{not json")
    line = _refused(validate.main, [GRPO, f"policy.model_path={hf}", f"run_root={tmp_path / 'runs'}"], capsys)
    assert line.startswith(f"error: policy.model_path='{hf}': its config.json is unreadable (JSONDecodeError"), line
