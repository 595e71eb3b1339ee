"""Warm starts across families: every run's checkpoints carry an `hf/` export (`checkpoints/global_step_N/hf`,
`checkpoints/best/hf`), the mlp's included, and `policy.model_path` takes it for its family. A checkpoint that does
not fit the config is refused offline by the one check path (pipelines.components.check_model_path: family, the
keys the family says a checkpoint fixes, the env it was trained on, the state / action lengths known offline) with
one line naming policy.model_path, the mismatch and the fix. A real warm start from the smoke run's best export
plays, at its step-0 eval, exactly the source's best eval, and records the export's fingerprint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.config import load_config
from tasks.config import ConfigError


def _export(args: list[str], path: Path, *, obs_dim: int, action_dim: int, **policy) -> Path:
    """An mlp export as a run writes it (tasks.actor.export.write_export with export_env_meta) of the config
    `args` composes, with `policy` keys replaced."""
    from dataclasses import replace

    from pipelines.graphs import export_env_meta
    from tasks.actor.export import write_export
    from tasks.policies import make_policy
    cfg = load_config(args, components=False)[0]
    pol = make_policy(replace(cfg.policy, **policy), obs_dim=obs_dim, action_dim=action_dim, seed=0, load=False)
    return Path(write_export(pol, str(path), export_env_meta(cfg)))


def _refusal(args: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(args)
    msg = str(e.value)
    assert e.value.key == "policy.model_path" and "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def pushcube_hf(tmp_path_factory) -> Path:
    """conf=smoke's policy (the mlp: 256-256-256 tanh) exported for PushCube-v1 (35-D state, 8-D actions)."""
    return _export(["conf=smoke"], tmp_path_factory.mktemp("export") / "hf", obs_dim=35, action_dim=8)


def test_an_mlp_export_is_a_model_path_for_the_mlp(pushcube_hf):
    cfg = load_config(["conf=smoke", f"policy.model_path={pushcube_hf}"])[0]
    assert cfg.policy.name == "mlp" and cfg.policy.model_path == str(pushcube_hf)


@pytest.mark.parametrize("override, saved, fix", [
    ("policy.hidden_sizes=[64,64]", "policy.hidden_sizes=[256,256,256]", "set policy.hidden_sizes=[256,256,256]"),
    ("policy.activation=relu", "policy.activation=tanh", "set policy.activation=tanh"),
])
def test_other_mlp_sizes_are_refused_naming_the_saved_ones(pushcube_hf, override, saved, fix):
    """The mlp's `checkpoint_keys` (hidden sizes: the weights' shapes; activation: their meaning) are compared with
    the export's config.json offline; the fix the message gives is accepted."""
    msg = _refusal(["conf=smoke", f"policy.model_path={pushcube_hf}", override])
    assert f"was saved with {saved}, this config has {override}" in msg and fix in msg
    load_config(["conf=smoke", f"policy.model_path={pushcube_hf}", override, fix.split()[-1]])


def test_an_mlp_export_is_refused_by_a_vla_and_a_vla_export_by_the_mlp(pushcube_hf, tmp_path):
    """The family is the export's config.json `family`: each direction names the policy group to choose."""
    msg = _refusal(["conf=smoke", "env=pushcube_vla", "policy=token_vla_tiny", f"policy.model_path={pushcube_hf}"])
    assert "holds a 'mlp' checkpoint, this config has policy.name=token_vla" in msg and "policy=mlp" in msg
    vla = tmp_path / "vla"
    vla.mkdir()
    (vla / "config.json").write_text(json.dumps({"family": "token_vla", "policy": {"preset": "tiny"}}))
    msg = _refusal(["conf=smoke", f"policy.model_path={vla}"])
    assert "holds a 'token_vla' checkpoint, this config has policy.name=mlp" in msg and "policy=token_vla_tiny" in msg


def test_an_mlp_export_of_another_env_is_refused(pushcube_hf):
    """ManiSkill's state and action lengths are known once an env is built: offline, the env task and controller
    the export recorded (config.json `env`) stand for them."""
    msg = _refusal(["conf=smoke", f"policy.model_path={pushcube_hf}", "env.env_id=PickCube-v1"])
    assert "was trained with env.env_id=PushCube-v1, this config has env.env_id=PickCube-v1" in msg
    msg = _refusal(["conf=smoke", f"policy.model_path={pushcube_hf}", "env.control_mode=pd_ee_delta_pos"])
    assert "was trained with env.control_mode=pd_joint_delta_pos" in msg


def test_an_mlp_export_of_other_state_or_action_lengths_is_refused(tmp_path):
    """Where the adapter knows the lengths offline (LIBERO: 8-D state, 14-D with env.object_state; 7-D actions)
    the export's obs_dim / action_dim are compared directly."""
    base = ["conf=libero_smoke", "policy=mlp", "env.obs_mode=state"]
    hf = _export([*base, "env.object_state=true"], tmp_path / "hf14", obs_dim=14, action_dim=7)
    msg = _refusal([*base, f"policy.model_path={hf}"])
    assert "reads a 14-D state, this env gives 8-D" in msg and "env.object_state" in msg
    load_config([*base, f"policy.model_path={hf}", "env.object_state=true"])
    hf = _export(base, tmp_path / "hf6", obs_dim=8, action_dim=6)
    assert "outputs 6-D actions, env.simulator=libero takes 7-D" in _refusal([*base, f"policy.model_path={hf}"])


def test_a_smoke_runs_best_export_warm_starts_a_run_whose_first_eval_is_that_eval(smoke_run, tmp_path, capsys):
    """The acceptance of warm starts, at smoke size: the session's conf=smoke run (the default family, the mlp)
    wrote `checkpoints/best/hf`; a new PPO run from it with runner.val_at_start=true evaluates the loaded weights at
    step 0 on the same fixed seeds with deterministic actions, so every episode record equals the source's best
    eval's (timing aside); the run records the export's fingerprint with its inputs (RunState.inputs, compared on
    resume) and the path in its resolved config."""
    from pipelines.run import main
    from pipelines.runner.setup import resolve_resume
    from storage.checkpoints import list_checkpoints, read_best
    from storage.exports import directory_fingerprint
    from tasks.evalstats import read_evals
    src = next(p for p in (smoke_run / "smoke").iterdir() if p.is_dir())
    for ckpt in list_checkpoints(src):  # every checkpoint has its export
        assert json.loads((ckpt / "hf" / "config.json").read_text())["family"] == "mlp"
    best = read_best(src)
    hf = src / "checkpoints" / "best" / "hf"
    args = ["conf=smoke", f"policy.model_path={hf}", "runner.val_at_start=true", "runner.max_steps=1",
            f"run_root={tmp_path}", "cluster.dashboard_address=127.0.0.1:0"]
    assert main(args) == 0
    capsys.readouterr()
    new = next(p for p in (tmp_path / "smoke").iterdir() if p.is_dir())
    untimed = lambda r: {s: {k: v for k, v in e.items() if "time" not in k}  # noqa: E731
                         for s, e in r["episodes"].items()}
    first, source = read_evals(new)[0], read_evals(src)[best["step"]]
    assert list(first["episodes"]) == list(source["episodes"])  # the same fixed seeds
    assert untimed(first) == untimed(source)
    assert first["summary"] == source["summary"]
    cfg = load_config([*args, "runner.max_steps=2", f"runner.resume={new.name}"])[0]
    res = resolve_resume(cfg)
    assert res.state.inputs == {"policy.model_path": directory_fingerprint(hf)}
    assert (new / "config.yaml").read_text().count(f"model_path: {hf}") == 1
