"""LeRobot datasets in and out of dagrl (tasks.demo_datasets, pipelines.export): SFT trains from the dataset the
LeRobot library wrote (tests/fixtures/lerobot_tiny); a recording exported and read back as `sft.store` gives the
recording's SFT samples (states, actions, tasks exactly; images within the video codec's error); a dataset that does
not fit the config is refused in one line naming the key and the dataset field. No simulator, no cluster."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pipelines import export as export_cli
from pipelines.config import load_config, sft_dataset
from storage.lerobot import write_dataset
from storage.trajectories import TrajectoryStore, write_shard
from tasks.config import ConfigError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_tiny"
# A recording's 32 px images after H.264 (yuv420p, CRF 18) and back: yuv420p keeps colour at half resolution (one
# chroma sample per 2x2 pixels) and RGB -> YUV -> RGB rounds, so even CRF 0 is not lossless; measured on PushCube's
# rendered 32 px images: 5.2 levels (of 255) mean absolute error, at most 5.8 in one image (4.25 at CRF 0). Bound:
MEAN_ABS_PER_IMAGE = 8.0


def _fixture_module():
    spec = importlib.util.spec_from_file_location("make_fixture", FIXTURE / "make_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cfg(tmp_path, store, *extra, conf=("conf=pushcube_pi0_sft",)):
    cfg, _ = load_config([*conf, f"sft.store={store}", "sft.value_coef=0", f"run_root={tmp_path / 'runs'}",
                          "sft.batch_size=8", "sft.only_success=false", *extra], components=False)
    return cfg


def test_sft_trains_from_the_dataset_the_lerobot_library_wrote(tmp_path):
    """The state mlp (C=1: one sample per frame) on the fixture: its samples are the frames, every task string maps
    to PushCube's one instruction, and behaviour cloning moves the weights and lowers the loss on the same batches."""
    import torch

    from tasks import demos
    from tasks.actor.actor import build_actor
    m = _fixture_module()
    cfg = sft_dataset(_cfg(tmp_path, FIXTURE, conf=("algorithm=sft", "policy=mlp")))
    assert cfg.sft.store.endswith(".zarr") and Path(cfg.sft.store).parent == (tmp_path / "runs" / "datasets").resolve()
    st = TrajectoryStore.open(cfg.sft.store)
    assert st.attrs["episodes"] == 3 and st.attrs["lerobot_dataset"] == str(FIXTURE)
    data = demos._dataset(cfg)  # every frame once, as (episode, t) rows
    eps = st.gather("episode_id", demos.sft_index(cfg.sft.store, False))
    order = np.lexsort((np.arange(len(eps)), eps))
    want = [(e, f) for e, L in enumerate(m.LENGTHS) for f in range(L)]
    np.testing.assert_array_equal(data["obs"][order], np.stack([m.state(e, f) for e, f in want]))
    np.testing.assert_array_equal(data["actions"][order][:, 0], np.stack([m.action(e, f) for e, f in want]))
    assert (data["task_id"] == 0).all()  # 'Push the cube to the goal region.' is PushCube's instruction too

    batches = demos.sft_load(cfg, seed=0, num_batches=4)
    actor = build_actor(cfg, 35, 8, load=False)
    weights = actor.weights()
    before = {k: v.clone() for k, v in weights["state_dict"].items()}
    losses = []
    for _ in range(5):
        weights = demos.sft_update(cfg, "lerobot-sft", weights, batches)
        losses.append(weights["metrics"]["train/sft_loss"])
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert any(not torch.equal(before[k], weights["state_dict"][k]) for k in before)


def _image(e: int, t: int) -> np.ndarray:
    """A rendered-looking 32 px image: a shaded background and a square whose place depends on (episode, t)."""
    y, x = np.mgrid[0:32, 0:32]
    img = np.stack([60 + 2 * x, 80 + y, np.full_like(x, 120)], -1).astype(np.uint8)
    r, c = 3 + 3 * (e % 5), 2 + 4 * t
    img[r:r + 7, c:c + 7] = (220, 50 + 30 * (e % 4), 40)
    return img


def _recording(path: Path, C=5, T=3, B=2, rounds=2, O=35, D=8) -> Path:
    """A store laid out as `pipelines.record` writes one (tasks.demos.record_round): round r holds one episode per
    env, env b's episode runs `lengths[r][b]` actions from t=0 (step_mask a prefix), its success set at its last chunk
    for even episodes."""
    from tasks.trajectory import Dims, record_schema
    rng = np.random.default_rng(0)
    lengths = [[15, 9], [12, 4]]
    fields = record_schema(Dims(obs_dim=O, action_dim=D, num_action_chunks=C, num_values=1, image_size=32))
    attrs = {"env_id": "PushCube-v1", "simulator": "maniskill", "obs_mode": "rgb",
             "control_mode": "pd_joint_delta_pos", "reward_mode": "normalized_dense", "base_seed": 500000,
             "auto_reset": False, "ignore_terminations": False, "num_action_chunks": C, "max_episode_steps": T * C,
             "gripper_convention": "open_positive", "robot_visual_lod": 1.0}
    st = TrajectoryStore.create(path, fields=fields, T=T, num_envs=B, shard_size=B, attrs=attrs)
    index = []
    for r in range(rounds):
        st.reserve(r)
        data = {k: np.zeros((T, B, *f.shape), f.dtype) for k, f in fields.items()}
        for b in range(B):
            e, L = r * B + b, lengths[r][b]
            data["episode_id"][:, b], data["episode_seed"][:, b], data["trial_id"][:, b] = e, 500000 + e, -1
            for t in range(T):
                n = max(0, min(C, L - t * C))
                data["obs"][t, b] = rng.normal(size=O)
                data["rgb"][t, b] = _image(e, t)
                data["actions"][t, b, :n] = rng.uniform(-1, 1, (n, D))
                data["rewards"][t, b, :n] = rng.uniform(0, 1, n)
                data["step_mask"][t, b, :n] = True
            last = (L - 1) // C
            data["success"][last, b] = e % 2 == 0
            data["truncated"][last, b] = True
            index.append({"episode_id": e, "seed": 500000 + e, "success_once": e % 2 == 0, "episode_len": L,
                          "task_id": 0, "trial_id": -1})
        write_shard(str(path), step=r, shard=0, data=data)
        st.mark_complete(r, global_step=r)
    st.update_attrs(episodes=len(index), successful_episodes=2, episode_index=index, teacher_run="test")
    return path


def _samples(store: str) -> dict:
    """The SFT samples of a store (every executed chunk step) in (episode_id, t) order."""
    from tasks.demo_index import sft_index
    st = TrajectoryStore.open(store)
    rows = sft_index(store, only_success=False)
    ep = st.gather("episode_id", rows)
    order = np.lexsort((rows[:, 1], ep))
    out = {k: st.gather(k, rows)[order] for k in ("obs", "rgb", "actions", "task_id", "step_mask", "rewards")}
    out["episode_id"] = ep[order]
    out["success_once"] = {i["episode_id"]: i["success_once"] for i in st.attrs["episode_index"]}
    return out


def test_a_recording_exported_and_read_back_gives_the_same_sft_samples(tmp_path, capsys):
    rec = _recording(tmp_path / "rec.zarr")
    out = tmp_path / "lerobot"
    assert export_cli.main([str(rec), "--format", "lerobot", "--out", str(out)]) == 0
    assert "4 episodes, 40 frames at 20 fps; state and images held over each chunk of 5 actions" in \
        capsys.readouterr().out
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["total_frames"] == 15 + 9 + 12 + 4  # one frame per executed action
    assert info["features"]["observation.images.rgb"]["shape"] == [32, 32, 3]
    cfg = sft_dataset(_cfg(tmp_path, out, "env.image_size=32"))
    a, b = _samples(str(rec)), _samples(cfg.sft.store)
    for k in ("episode_id", "obs", "actions", "task_id", "step_mask", "rewards"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)  # float32 through parquet: exact
    assert a["success_once"] == b["success_once"]
    err = np.abs(a["rgb"].astype(int) - b["rgb"].astype(int)).reshape(len(a["rgb"]), -1).mean(1)
    assert err.max() < MEAN_ABS_PER_IMAGE
    d = np.abs(a["rgb"][:, None].astype(int) - b["rgb"][None].astype(int)).mean(axis=(2, 3, 4))
    np.testing.assert_array_equal(d.argmin(0), np.arange(len(d)))  # each image nearest its own source
    # a second conversion under the same settings is the same store; another chunk length is refused
    assert sft_dataset(_cfg(tmp_path, out, "env.image_size=32")).sft.store == cfg.sft.store
    with pytest.raises(ConfigError, match=r"new observation every 5 frames .* policy.num_action_chunks=2"):
        sft_dataset(_cfg(tmp_path, out, "env.image_size=32", "policy.num_action_chunks=2"))
    # the export's own refusals: an existing --out, a store that is not a recording
    assert export_cli.main([str(rec), "--out", str(out)]) == 2
    assert "exists; choose a new directory" in capsys.readouterr().err
    assert export_cli.main([str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "is not a trajectory store" in capsys.readouterr().err


def _dataset(tmp_path, *, task="push the cube to the goal region", cameras=True, state=35, action=8) -> Path:
    out = tmp_path / f"ds-{task[:4]}-{cameras}-{state}-{action}"
    L = 6
    write_dataset(out, [{"state": np.zeros((L, state), np.float32), "action": np.zeros((L, action), np.float32),
                         "images": {"observation.images.rgb": np.zeros((L, 32, 32, 3), np.uint8)} if cameras else {},
                         "task": task}], fps=20)
    return out


@pytest.mark.parametrize("case, key, line", [
    ("no camera", "sft.store", r"has 0 camera video\(s\) \[\] in meta/info.json's features, the config wants 1"),
    ("other task", "sft.store", r"episode 0's task 'open the drawer' \(meta/tasks.parquet\) is not an instruction"),
    ("no reward", "sft.value_coef", r"has no 'next.reward' feature to fit a critic to: use sft.value_coef=0"),
    ("libero state", "sft.store", r"features\['observation.state'\].shape is \[35\], this env's state is 14-D"),
    ("old format", "sft.store", r"codebase_version='v2.1'; dagrl reads v3.0"),
])
def test_a_dataset_that_does_not_fit_is_refused_naming_the_key_and_field(tmp_path, case, key, line):
    extra, conf = [], ("conf=pushcube_pi0_sft",)
    if case == "no camera":
        ds = _dataset(tmp_path, cameras=False)
    elif case == "other task":
        ds = _dataset(tmp_path, task="open the drawer")
    elif case == "no reward":
        ds, extra = FIXTURE, ["sft.value_coef=1"]
    elif case == "libero state":
        ds, conf = FIXTURE, ("conf=libero_pi0_sft",)
    else:
        import shutil
        ds = tmp_path / "old"
        shutil.copytree(FIXTURE, ds)
        info = json.loads((ds / "meta" / "info.json").read_text())
        (ds / "meta" / "info.json").write_text(json.dumps({**info, "codebase_version": "v2.1"}))
    cfg = _cfg(tmp_path, ds, conf=conf)
    if extra:
        from tasks.config import replace_key
        cfg = replace_key(cfg, "sft.value_coef", 1.0)
    with pytest.raises(ConfigError, match=line) as err:
        sft_dataset(cfg)
    assert err.value.key == key and "\n" not in str(err.value)
    assert not (tmp_path / "runs" / "datasets").exists() or not any((tmp_path / "runs" / "datasets").glob("*.zarr"))
