"""SFT sample selection from a hand-built trajectory store (no simulator): which chunk steps are learned from."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.trajectories import FieldSpec, TrajectoryStore, clear_cache, write_shard
from tasks import resident
from tasks.config import Config, family_class, replace_key, replace_keys
from tasks.demos import sft_index, sft_load


@pytest.fixture()
def store(tmp_path):
    """2 complete steps (the store's leading dimension: training steps, here recording rounds) + 1 incomplete,
    T=3 chunk steps, B=2 envs (one shard), C=2, D=1.

    step 0: env 0 = episode 0, successful at t=1, ends at t=1 (t=2 idle: no executed action);
            env 1 = episode 1, never successful.
    step 1: env 0 = episode 2, never successful; env 1 = episode 3, successful at t=2.
    step 2: written but not marked complete (must be ignored).
    """
    path = tmp_path / "demos.zarr"
    fields = {"obs": FieldSpec((1,), "float32"), "actions": FieldSpec((2, 1), "float32"),
              "step_mask": FieldSpec((2,), "bool"), "success": FieldSpec((), "bool"),
              "episode_id": FieldSpec((), "int64"), "task_id": FieldSpec((), "int64")}
    st = TrajectoryStore.create(path, fields=fields, T=3, num_envs=2, shard_size=2)
    step_mask = np.ones((3, 3, 2, 2), bool)
    step_mask[0, 2, 0] = False  # step 0, env 0 idle at t=2
    success = np.zeros((3, 3, 2), bool)
    success[0, 1, 0] = True
    success[1, 2, 1] = True
    success[2] = True
    episode_id = np.array([[[0, 1]] * 3, [[2, 3]] * 3, [[4, 5]] * 3])
    episode_id[0, 2, 0] = -1
    for e in range(3):
        st.reserve(e)
        obs = np.arange(6, dtype=np.float32).reshape(3, 2, 1) + 100 * e  # value = 100 e + 2 t + b
        write_shard(str(path), step=e, shard=0, data={
            "obs": obs, "actions": obs[..., None].repeat(2, axis=2), "step_mask": step_mask[e],
            "success": success[e], "episode_id": episode_id[e], "task_id": np.zeros((3, 2), np.int64)})
        if e < 2:
            st.mark_complete(e)
    yield path
    clear_cache()


def _one_step_store(path, data: dict) -> str:
    """A store holding one complete step: `data` name -> array [T, B, ...] (the fields' per-sample shapes and
    dtypes read from it; B envs in one shard; `task_id` 0 unless given: one task's episodes)."""
    T, B = next(iter(data.values())).shape[:2]
    data = {"task_id": np.zeros((T, B), np.int64), **data}
    fields = {k: FieldSpec(v.shape[2:], str(v.dtype)) for k, v in data.items()}
    st = TrajectoryStore.create(path, fields=fields, T=T, num_envs=B, shard_size=B)
    st.reserve(0)
    write_shard(str(path), step=0, shard=0, data=data)
    st.mark_complete(0)
    return str(path)


def test_sft_index_keeps_executed_chunk_steps_of_successful_episodes_in_complete_steps(store):
    rows = sft_index(str(store), only_success=True)
    # episode 0: t=0,1 of env 0 in step 0 (t=2 idle); episode 3: t=0..2 of env 1 in step 1
    assert rows.tolist() == [[0, 0, 0], [0, 1, 0], [1, 0, 1], [1, 1, 1], [1, 2, 1]]
    everything = sft_index(str(store), only_success=False)
    assert len(everything) == 2 * 3 * 2 - 1  # every executed chunk step of the 2 complete steps


def test_sft_load_draws_seeded_minibatches_of_the_selected_samples(store):
    cfg = replace_keys(Config(), {"sft.store": str(store), "sft.batch_size": 4})
    resident.release("sft_data/")
    a, b = sft_load(cfg, seed=3, num_batches=2), sft_load(cfg, seed=3, num_batches=2)
    assert len(a) == 2 and a[0]["obs"].shape == (4, 1) and a[0]["actions"].shape == (4, 2, 1)
    np.testing.assert_array_equal(a[1]["obs"], b[1]["obs"])
    allowed = {0.0, 2.0, 101.0, 103.0, 105.0}  # obs values of the selected rows (100 e + 2 t + b)
    assert set(np.concatenate([x["obs"].ravel() for x in a]).tolist()) <= allowed
    resident.release("sft_data/")


def test_sft_index_names_the_store_when_nothing_is_selectable(tmp_path):
    path = _one_step_store(tmp_path / "empty.zarr", {"step_mask": np.ones((1, 1, 1), bool),
                                                    "success": np.zeros((1, 1), bool),
                                                    "episode_id": np.zeros((1, 1), np.int64)})
    with pytest.raises(ValueError, match="empty.zarr: no chunk step to learn from in a successful episode"):
        sft_index(path, only_success=True)
    clear_cache()


def test_chunk_returns_hand_case():
    """gamma 0.5. env 0: chunk rewards 1, 2, then idle; cut by the time limit at t=1 -> tail 2 / (1 - 0.5) = 4.
    env 1: chunk rewards 1, 0, 2, terminated at t=2 -> no tail."""
    from tasks.demos import chunk_returns
    rewards = np.array([[[1, 0], [1, 0]], [[2, 0], [0, 0]], [[0, 0], [1, 1]]], np.float32)  # [T=3, B=2, C=2]
    mask = np.ones((3, 2, 2), bool)
    mask[1, 0, 1] = False
    mask[2, 0] = False
    truncated = np.zeros((3, 2), bool)
    truncated[1, 0] = True
    g = chunk_returns(rewards, mask, truncated, gamma=0.5)
    # env 0: G1 = 2 + 0.5 * 4 = 4, G0 = 1 + 0.5 * 4 = 3; env 1: G2 = 2, G1 = 0 + 1 = 1, G0 = 1 + 0.5 = 1.5
    np.testing.assert_allclose(g, [[3.0, 1.5], [4.0, 1.0], [0.0, 2.0]])
    np.testing.assert_allclose(chunk_returns(rewards, mask, truncated, gamma=0.5, reward_scale=0.2), 0.2 * g,
                               rtol=1e-6)


def test_sft_value_warm_start_loads_every_episode_with_returns_and_the_bc_flag(tmp_path):
    """With sft.value_coef > 0 the samples are all executed chunk steps; `bc` marks the successful episodes'
    ones and `returns` are the chunk returns of their step."""
    obs = np.array([[[0.0], [1.0]], [[2.0], [3.0]]], np.float32)  # value = 2 t + b
    path = _one_step_store(tmp_path / "v.zarr", {
        "obs": obs, "actions": obs[..., None], "rewards": np.array([[[1.0], [0.0]], [[1.0], [2.0]]], np.float32),
        "step_mask": np.ones((2, 2, 1), bool), "truncated": np.array([[False, False], [True, True]]),
        "success": np.array([[False, False], [True, False]]), "episode_id": np.array([[0, 1], [0, 1]], np.int64)})
    cfg = replace_keys(Config(), {"sft.store": path, "sft.batch_size": 64, "sft.value_coef": 1.0,
                                  "algorithm.gamma": 0.5, "algorithm.reward_scale": 1.0})
    resident.release("sft_data/")
    try:
        (b,) = sft_load(cfg, seed=0, num_batches=1)
    finally:
        resident.release("sft_data/")
        clear_cache()
    expected = {0.0: (True, 1 + 0.5 * 2.0), 1.0: (False, 0 + 0.5 * 4.0), 2.0: (True, 2.0), 3.0: (False, 4.0)}
    for o, bc, ret in zip(b["obs"][:, 0], b["bc"], b["returns"]):
        assert (bool(bc), float(ret)) == pytest.approx(expected[float(o)])
    assert set(b["obs"][:, 0].tolist()) == {0.0, 1.0, 2.0, 3.0}


def test_rows_in_matches_the_set_definition_and_stays_linear_in_memory():
    """`rows_in` marks exactly the rows that are in the subset (against a Python set), and a store-sized call
    (60k x 40k chunk steps, an RL run's store: the pairwise comparison it replaced needed 7 GB for these) stays
    within a few MB (tracemalloc sees numpy's allocations)."""
    import tracemalloc

    from tasks.demos import rows_in
    rng = np.random.default_rng(0)
    rows = np.unique(rng.integers(0, [7, 5, 9], size=(200, 3)), axis=0)
    subset = np.concatenate([rows[rng.random(len(rows)) < 0.4], rng.integers(0, [9, 6, 11], size=(20, 3))])
    want = {tuple(r) for r in subset.tolist()}
    assert rows_in(rows, subset).tolist() == [tuple(r) in want for r in rows.tolist()]
    assert rows_in(rows, subset[:0]).tolist() == [False] * len(rows)
    assert rows_in(rows[:0], subset).shape == (0,)
    big = np.argwhere(np.ones((36, 10, 168), bool)).astype(np.int64)  # 60480 rows
    part = big[rng.random(len(big)) < 0.66]
    tracemalloc.start()
    try:
        got = rows_in(big, part)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.sum() == len(part) and peak < 20e6, peak


def test_value_only_pass_moves_the_value_head_only(tmp_path):
    """sft.bc_coef=0 with sft.value_coef > 0 on a state-only flow VLA (value_detach, asymmetric critic): after the
    gradient steps every non-value tensor equals the loaded weights and the value head has moved."""
    from tasks.demos import sft_update
    from tasks.policies import make_policy
    r = np.random.default_rng(0)
    path = _one_step_store(tmp_path / "v.zarr", {
        "obs": r.standard_normal((2, 2, 3)).astype(np.float32),
        "actions": r.uniform(-1, 1, (2, 2, 2, 2)).astype(np.float32),
        "rewards": r.uniform(0, 1, (2, 2, 2)).astype(np.float32), "step_mask": np.ones((2, 2, 2), bool),
        "truncated": np.array([[False, False], [True, True]]), "success": np.array([[False, False], [True, False]]),
        "episode_id": np.array([[0, 1], [0, 1]], np.int64)})
    p = family_class("policy", "token_vla")(preset="tiny", num_action_chunks=2, max_prompt_len=8, value_detach=True,
                                           critic_state=True, value_head="last_token")
    cfg = replace_keys(Config(), {"env.obs_mode": "state", "policy": p, "sft.store": path, "sft.batch_size": 8,
                                  "sft.value_coef": 1.0, "sft.bc_coef": 0.0})
    policy = make_policy(p, obs_dim=3, action_dim=2, seed=0)
    w0 = {"version": 0, "state_dict": {k: v.clone() for k, v in policy.state_dict().items()}}
    resident.release("sft_data/")
    try:
        out = sft_update(cfg, "value-only", w0, sft_load(cfg, seed=0, num_batches=3))
    finally:
        resident.release("sft_data/")
        resident.release("value-only")
        clear_cache()
    for k, v in out["state_dict"].items():
        if k.startswith("value_head."):
            continue
        assert torch.equal(v, w0["state_dict"][k]), k
    assert not torch.equal(out["state_dict"]["value_head.mlp.0.weight"], w0["state_dict"]["value_head.mlp.0.weight"])
    assert out["metrics"]["train/critic_loss"] > 0


@pytest.mark.parametrize("overrides, words", [
    (["sft.bc_coef=0", "policy.value_detach=false"], "set policy.value_detach=true"),
    (["sft.bc_coef=0", "sft.value_coef=0"], "0 together with sft.value_coef > 0"),
    (["sft.value_coef=-1"], "use >= 0"),
    (["algorithm.reward_type=action_level", "algorithm.logprob_type=action_level"], "reward_type=chunk_level")])
def test_value_warm_start_settings_are_checked_offline(store, overrides, words):
    from pipelines.config import load_config
    from tasks.config import ConfigError
    with pytest.raises(ConfigError) as info:
        load_config(["conf=pushcube_token_sft", f"sft.store={store}", *overrides], components=False)
    assert words in str(info.value) and "sft." in str(info.value)


class _EpisodeEnv:
    """Single env whose episodes last `length` steps (then truncated); obs = [reset seed], reward 1 per step."""
    obs_dim, action_dim = 1, 2

    def __init__(self, length: int):
        self.length, self.t, self.s = length, 0, 0

    def reset(self, seed):
        self.t, self.s = 0, seed
        return np.array([seed], np.float32)

    def step(self, action):
        self.t += 1
        return np.array([self.s], np.float32), 1.0, False, self.t >= self.length, False

    def close(self):
        pass


@pytest.mark.parametrize("length", [5, 3, 50])  # an episode fills the round, ends early, is cut by the round's end
def test_record_rounds_follow_the_record_seed_rule(monkeypatch, length):
    """record_round's episodes: round k of global env g has reset seed env.seed + g + k * num_envs
    (tasks.seeding.RECORD_SEED_RULE) in every round, one episode per env per round, on the resident shard that
    the rounds share (fake envs, no simulator, no store: write_shard is captured)."""
    from storage import trajectories
    from tasks import demos
    from tasks.envs.shard import EnvShard
    cfg = replace_keys(Config(), {"env.num_envs": 4, "env.num_shards": 2, "env.seed": 100, "env.max_episode_steps": 5,
                                  "policy.num_action_chunks": 2})  # T = ceil(5 / 2) = 3 chunk steps per round
    written = {}

    class Teacher:
        def act(self, obs, deterministic):
            return {"actions": torch.zeros(len(obs["state"]), 1, 2)}

    monkeypatch.setattr(demos, "make_shard", lambda e, shard, num_shards, num_envs, **kw: EnvShard(
        [_EpisodeEnv(length) for _ in range(num_envs // num_shards)], env_offset=shard * (num_envs // num_shards),
        num_envs_total=num_envs, **kw))
    monkeypatch.setattr(demos, "_teacher", lambda *a: Teacher())
    monkeypatch.setattr(trajectories, "write_shard", lambda path, step, shard, data: written.update(
        {(step, shard): data}))
    try:
        out = {(k, s): demos.record_round(cfg, cfg, "ckpt", s, k, "mem://demos") for k in range(3) for s in range(2)}
    finally:
        resident.release("record/mem://demos")
    for (k, s), data in written.items():
        g = np.arange(2) + 2 * s
        np.testing.assert_array_equal(data["episode_seed"][0], 100 + g + 4 * k)
        np.testing.assert_array_equal(data["obs"][0, :, 0], 100 + g + 4 * k)  # the env was reset with it
        np.testing.assert_array_equal(data["episode_id"][0], g + 4 * k)
        assert data["step_mask"].sum() == 2 * min(length, 6)  # executed actions: the episode's, at most T * C = 6
        ended = [e["seed"] for e in out[k, s]["episodes"]]  # a cut episode (length 50) is not reported
        assert ended == ([] if length > 6 else (100 + g + 4 * k).tolist())


def _sft_cfg(name: str, C: int, store: str) -> Config:
    """SFT from scratch of the tiny VLA `name` (C actions per chunk) on a state-only store."""
    return replace_keys(Config(), {
        "env.obs_mode": "state", "algorithm.name": "sft", "sft.store": store,
        "policy": family_class("policy", name)(preset="tiny", num_action_chunks=C, max_prompt_len=8)})


def test_token_vla_sft_from_scratch_takes_q01_q99_of_the_executed_bc_actions(tmp_path):
    """OpenVLA's dataset statistics: q01 / q99 per dimension of the executed actions of the successful episodes
    only (the idle slot and the failed episode hold outliers that would move them), and only when SFT starts from
    scratch with a policy that has the statistics."""
    from tasks.demos import set_demo_stats
    from tasks.policies import make_policy
    r = np.random.default_rng(0)
    T, B, C, D = 4, 2, 2, 3
    actions = r.uniform(-0.3, 0.5, (T, B, C, D)).astype(np.float32)
    step_mask = np.ones((T, B, C), bool)
    step_mask[3, 0, 1] = False  # env 0's last action slot idle
    actions[3, 0, 1] = 9.0
    actions[:, 1] = -7.0  # env 1: a failed episode
    path = _one_step_store(tmp_path / "a.zarr", {
        "obs": r.standard_normal((T, B, 3)).astype(np.float32), "actions": actions, "step_mask": step_mask,
        "success": np.array([[False, False]] * 3 + [[True, False]]), "episode_id": np.array([[0, 1]] * T, np.int64)})
    cfg = _sft_cfg("token_vla", C, path)
    p = cfg.policy
    policy = make_policy(p, obs_dim=3, action_dim=D, seed=0)
    try:
        assert set_demo_stats(cfg, policy)
        executed = actions[:, 0].reshape(-1, D)[step_mask[:, 0].reshape(-1)]  # [7, D]
        assert len(executed) == T * C - 1
        q01, q99 = np.percentile(executed.astype(np.float64), [1.0, 99.0], axis=0)
        assert torch.allclose(policy.action_q01, torch.tensor(q01, dtype=torch.float32))
        assert torch.allclose(policy.action_q99, torch.tensor(q99, dtype=torch.float32))
        assert float(policy.action_q99.max()) < 0.5 and float(policy.action_q01.min()) > -0.3
        fresh = make_policy(p, obs_dim=3, action_dim=D, seed=0)
        cfg = replace_key(cfg, "policy.model_path", str(tmp_path))  # a loaded policy keeps its own statistics
        assert not set_demo_stats(cfg, fresh)
        cfg = replace_keys(cfg, {"policy.model_path": None, "algorithm.name": "grpo"})
        assert not set_demo_stats(cfg, fresh)
        assert torch.equal(fresh.action_q01, torch.full((D,), -1.0))
    finally:
        clear_cache()


def _env0_succeeds_store(tmp_path, obs, actions, step_mask) -> str:
    """A one-step store of 2 envs x 4 chunk steps: env 0's episode succeeds at chunk step 2 (a BC sample source),
    env 1's fails (never a sample)."""
    T = obs.shape[0]
    return _one_step_store(tmp_path / "s.zarr", {
        "obs": obs, "actions": actions, "step_mask": step_mask,
        "success": np.array([[False, False]] * 2 + [[True, False]] * (T - 2)),
        "episode_id": np.array([[0, 1]] * T, np.int64)})


def test_vla_sft_with_normalize_state_standardises_by_the_bc_samples_state(tmp_path):
    """`policy.normalize_state`: SFT from scratch sets the prefix's state mean / std to those of the behaviour-
    cloning samples' states (the successful episode's executed chunk steps only), the std floored at 0.01; the
    prefix then sees (state - mean) / std, i.e. exactly what an identity-stats prefix sees for the standardised
    state. Without the key, or with a loaded checkpoint, the identity stays."""
    from tasks.demo_index import STATE_STD_FLOOR
    from tasks.demos import set_demo_stats
    from tasks.policies import make_policy
    r = np.random.default_rng(1)
    T, B, C, D, O = 4, 2, 2, 3, 3
    obs = np.stack([r.normal(1.0, 0.2, (T, B)), r.normal(0.0, 0.001, (T, B)), r.normal(-3.0, 5.0, (T, B))],
                   -1).astype(np.float32)
    obs[:, 1] = 50.0  # env 1: a failed episode (not a BC sample)
    step_mask = np.ones((T, B, C), bool)
    step_mask[3, 0] = False  # env 0's episode ended before chunk step 3: not a sample
    cfg = _sft_cfg("token_vla", C, _env0_succeeds_store(tmp_path, obs, np.zeros((T, B, C, D), np.float32), step_mask))
    p = cfg.policy
    try:
        policy = make_policy(p, obs_dim=O, action_dim=D, seed=0)
        set_demo_stats(cfg, policy)  # normalize_state off: the token VLA's action q01 / q99 only, no state stats
        assert torch.equal(policy.prefix.state_std, torch.ones(O))
        cfg = replace_key(cfg, "policy.normalize_state", True)
        assert set_demo_stats(cfg, policy)
        samples = obs[:3, 0].astype(np.float64)  # env 0, chunk steps 0-2
        assert samples.std(0)[1] < STATE_STD_FLOOR
        torch.testing.assert_close(policy.prefix.state_mean, torch.tensor(samples.mean(0), dtype=torch.float32))
        torch.testing.assert_close(policy.prefix.state_std, torch.tensor(
            np.maximum(samples.std(0), STATE_STD_FLOOR), dtype=torch.float32))
        # the standardisation is the prefix's input: stats (m, s) on x == identity stats on (x - m) / s
        ident = make_policy(cfg.policy, obs_dim=O, action_dim=D, seed=0)
        prompt = ident.tokenize(["push"] * 2)
        x = torch.from_numpy(obs[:2, 0])
        z = (x - policy.prefix.state_mean) / policy.prefix.state_std
        torch.testing.assert_close(policy.prefix({"prompt": prompt, "state": x}).hidden,
                                   ident.prefix({"prompt": prompt, "state": z}).hidden)
        # saved with the weights; a checkpoint from before the buffers loads with the identity
        policy.save_pretrained(tmp_path / "hf")
        loaded = type(policy).from_pretrained(tmp_path / "hf")
        assert torch.equal(loaded.prefix.state_std, policy.prefix.state_std)
        from safetensors.torch import load_file, save_file
        w = load_file(str(tmp_path / "hf" / "model.safetensors"))
        save_file({k: v for k, v in w.items() if not k.startswith("prefix.state_")} |
                  {k: v for k, v in w.items() if k.startswith("prefix.state_proj")},
                  str(tmp_path / "hf" / "model.safetensors"))
        old = type(policy).from_pretrained(tmp_path / "hf")
        assert torch.equal(old.prefix.state_std, torch.ones(O)) and torch.equal(old.prefix.state_mean, torch.zeros(O))
        # the same for a run checkpoint's state dict (resume, pipelines.eval of a run, FSDP initial weights)
        sd = {k: v for k, v in policy.state_dict().items() if k not in ("prefix.state_mean", "prefix.state_std")}
        policy.load_state_dict(sd)
        assert torch.equal(policy.prefix.state_std, torch.ones(O)) and torch.equal(policy.prefix.state_mean,
                                                                                    torch.zeros(O))
        fresh = make_policy(cfg.policy, obs_dim=O, action_dim=D, seed=0)
        cfg = replace_key(cfg, "policy.model_path", str(tmp_path / "hf"))  # a loaded policy keeps its own statistics
        assert not set_demo_stats(cfg, fresh)
        with pytest.raises(ValueError, match="std must be > 0"):
            policy.prefix.set_state_stats(np.zeros(O), np.array([1.0, 0.0, 1.0]))
    finally:
        clear_cache()
