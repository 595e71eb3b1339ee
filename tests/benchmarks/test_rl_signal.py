"""benchmarks/rl_signal.py: the advantage estimators it compares, on a hand-computed rollout (no simulator)."""
import numpy as np
import pytest


@pytest.fixture(scope="module")
def sig(load_benchmark):
    return load_benchmark("rl_signal")


def _batch(r):
    """One rollout of T=3 chunk steps, B=4 envs (one group of 4 with G=4, two of 2 with G=2), C=2 actions each
    holding half of the chunk's reward; every episode truncated at the last chunk step (ignore_terminations)."""
    r = np.asarray(r, np.float32)  # [T, B] chunk rewards
    T, B = r.shape
    trunc = np.zeros((T, B), bool)
    trunc[-1] = True
    return {"rewards": np.repeat(r[..., None] / 2, 2, axis=-1), "terminated": np.zeros((T, B), bool),
            "truncated": trunc, "step_mask": np.ones((T, B, 2), bool),
            "success": np.array([[0, 0, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], bool)}


R = [[1, 0, 2, 0], [0, 1, 2, 3], [1, 1, 2, 1]]  # scores 2, 2, 6, 4


def test_reward_to_go_minus_the_leave_one_out_mean_at_the_same_step(sig):
    adv = sig.estimator_advantages("rtg", _batch(R), G=2)
    # reward-to-go per env: t=0: 2, 2, 6, 4; t=1: 1, 2, 4, 4; t=2: 1, 1, 2, 1; groups (0, 1), (2, 3)
    rtg = np.array([[2, 2, 6, 4], [1, 2, 4, 4], [1, 1, 2, 1]], np.float32)
    other = rtg[:, [1, 0, 3, 2]]  # the one other member of each group of 2
    np.testing.assert_allclose(adv, rtg - other)


def test_dr_grpo_and_success_scores(sig):
    b = _batch(R)
    adv = sig.estimator_advantages("grpo_nostd", b, G=4)  # score - group mean (3.5), broadcast over the 3 steps
    np.testing.assert_allclose(adv, np.tile(np.array([2, 2, 6, 4], np.float32) - 3.5, (3, 1)))
    s = np.array([0, 1, 1, 0], np.float32)  # success_once of the 4 envs; mean 0.5, unbiased std 0.5774
    adv = sig.estimator_advantages("success", b, G=4)
    np.testing.assert_allclose(adv, np.tile((s - 0.5) / (np.std(s, ddof=1) + 1e-6), (3, 1)), rtol=1e-5)
    g = sig.estimator_advantages("grpo", b, G=4)
    sc = np.array([2, 2, 6, 4], np.float32)
    np.testing.assert_allclose(g, np.tile((sc - sc.mean()) / (np.std(sc, ddof=1) + 1e-6), (3, 1)), rtol=1e-5)


def test_cosine_of_two_noisy_estimates(sig):
    import torch
    rng = np.random.default_rng(0)
    s = torch.zeros(20000)
    s[0] = 1.0
    n = [torch.from_numpy(rng.standard_normal(20000).astype(np.float32)) / np.sqrt(20000) for _ in range(2)]
    # |n_i|^2 ~ |s|^2 (r = 1): the expected cosine of s + n_0 and s + n_1 is 1 / (1 + r) = 0.5
    assert sig.cosine(s + n[0], s + n[1]) == pytest.approx(0.5, abs=0.03)
    with pytest.raises(SystemExit, match="use grpo"):
        sig.estimator_advantages("vtrace", _batch(R), G=2)


def test_gae_with_the_value_head_and_a_bootstrapped_last_step(sig):
    """`gae`: delta_t = s r_t + gamma V_{t+1} - V_t (the last chunk step bootstrapped from V of the final obs),
    A_t = delta_t + gamma lam A_{t+1}, then (A - mean) / std over the whole batch (population std), by a loop."""
    from types import SimpleNamespace
    b = _batch(R)
    r = np.asarray(R, np.float64)
    T, B = r.shape
    v = np.array([[0.5, 0.0, 1.0, 0.2], [0.4, 0.1, 0.9, 0.3], [0.3, 0.2, 0.8, 0.4], [2.0, -1.0, 0.5, 0.0]])
    b["values"] = v.astype(np.float32)  # [T + 1, B]; row T: V(final obs)
    ppo = SimpleNamespace(gamma=0.8, gae_lambda=0.9, reward_scale=0.2)
    want = np.zeros((T, B))
    for j in range(B):
        run = 0.0
        for t in reversed(range(T)):
            run = 0.2 * r[t, j] + 0.8 * v[t + 1, j] - v[t, j] + 0.8 * 0.9 * run
            want[t, j] = run
    want = (want - want.mean()) / want.std()
    np.testing.assert_allclose(sig.estimator_advantages("gae", b, G=2, ppo=ppo), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(SystemExit, match="no value head"):
        sig.estimator_advantages("gae", _batch(R), G=2, ppo=ppo)


class _Shard:
    """B envs with random state/rgb observations and zero rewards: what `rollout` reads of an EnvShard."""

    def __init__(self, B, O, img, seed=0):
        self.B, self.O, self.img, self.g = B, O, img, np.random.default_rng(seed)

    def begin_rollout(self):
        pass

    def current_obs(self):
        return self.g.standard_normal((self.B, self.O)).astype(np.float32)

    def current_rgb(self):
        return self.g.integers(0, 256, (self.B, self.img, self.img, 3), dtype=np.uint8)

    def chunk_step(self, actions):
        from types import SimpleNamespace
        B, C = actions.shape[:2]
        return SimpleNamespace(rewards=np.zeros((B, C), np.float32), terminated=np.zeros(B, bool),
                               truncated=np.zeros(B, bool), step_mask=np.ones((B, C), bool), success=np.zeros(B, bool))


@pytest.mark.parametrize("name", ["pi0", "token_vla"])
def test_surrogate_gradient_of_either_vla_family_equals_the_per_sample_loop(sig, name):
    """`rollout` keeps each family's `act` extras (flow: chain + denoise_idx, token: tokens) and `surrogate_grad`
    (chunked) equals the gradient of -sum_n A_n sum_{c,d} log pi_n[c, d] / (N C D) computed sample by sample."""
    import torch

    from tasks.config import family_class
    from tasks.policies import make_policy
    from tasks.rollout import policy_obs
    torch.manual_seed(0)
    O, D, img, instr = 4, 3, 16, "push the cube"
    pol = make_policy(family_class("policy", name)(num_action_chunks=2, max_prompt_len=16), obs_dim=O, action_dim=D,
                      image_size=img).eval()
    batch = sig.rollout(pol, _Shard(3, O, img), instr, chunk_steps=2)  # T=2, B=3
    extras = sorted(k for k in batch if k.startswith(sig.EXTRA))
    assert extras == (["extras/chain", "extras/denoise_idx"] if name == "pi0" else ["extras/tokens"])
    # the value head's V(s_t) per chunk step and V of the final observation (the `gae` estimator's critic)
    assert batch["values"].shape == (3, 3) and batch["values"].dtype == np.float32
    adv = np.array([[1.0, -2.0, 0.5], [0.0, 1.5, -1.0]], np.float32)
    params = [p for p in pol.parameters() if p.requires_grad]
    got = sig.surrogate_grad(pol, params, batch, adv, instr, chunk=4)  # N=6: chunks of 4 and 2
    pol.zero_grad(set_to_none=True)
    total = 0.0
    for t in range(2):
        for b in range(3):
            out = pol.evaluate(policy_obs(pol, batch["obs"][t, b:b + 1], batch["rgb"][t, b:b + 1], instr),
                               torch.from_numpy(batch["actions"][t, b:b + 1]),
                               {k[len(sig.EXTRA):]: torch.from_numpy(batch[k][t, b:b + 1]) for k in extras})
            total = total - float(adv[t, b]) * out["logprobs"].sum() / (6 * 2 * D)
    total.backward()
    want = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params])
    assert float(want.norm()) > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
