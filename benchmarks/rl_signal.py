"""How much signal one RL update of a VLA carries, and how far along it the policy can move: the measurement behind
the VLA recipe's RL settings (README, "VLA policies").

    .venv/bin/python benchmarks/rl_signal.py --model-path SFT_RUN/checkpoints/global_step_30/hf \
        [--conf pushcube_pi0_grpo] [--envs 128] [--batches 2] [--eval-episodes 48] \
        [--steps sign:1e-4 sign:2e-4 sign:5e-4 sgd:0.03 sgd:0.1 rand:0.3] [--set KEY=VALUE ...]

Either VLA family: a token VLA's checkpoint with `--conf pushcube_token_grpo` (its log-probs are the tokens'; the
flow VLA's the denoising chain's).

In one process, no Dask (the same task functions the graph runs):
1. Rollouts: `--batches` rollouts of `--envs` envs (one env shard, GRPO groups of `algorithm.group_size` sharing
   reset seeds, one episode per env, stochastic sampling), each from its own seeds; GRPO advantages
   (tasks.algorithms.grpo_advantages on the chunk rewards). Batch 0's reset seeds are also run with the ODE (the
   eval's policy: no noise in the denoising steps; its initial noise x_1 ~ N(0, I) is still drawn, from the
   torch generator's state after that batch): success_once of both on the same env episodes.
2. Gradients: for each batch, the gradient g_i of the PPO surrogate at ratio 1 with token-level log-probs,
   -mean over (chunk steps, C, D) of A * log pi (what the update's first minibatch step follows). Printed: the
   cosine between the batches' gradients (two independent estimates of the same expectation: cos ~ 1 means
   signal, ~ 0 noise; for estimates s + n_i with |n_i|^2 = r |s|^2 the expected cosine is 1 / (1 + r)), their
   norms, and the parameter tensors carrying most of the summed gradient's squared norm.
3. Line search along the summed gradient g = sum_i g_i from the loaded weights theta_0, one deterministic (ODE)
   eval on the fixed eval seeds (`env.eval.seed + i`, as the pipeline's eval) per entry of `--steps`:
       sign:s   theta_0 - s * sign(g)        (what Adam's first steps do: every parameter moves by s)
       sgd:s    theta_0 - s * g / |g|        (an L2 step of length s along the gradient)
       rand:s   theta_0 + s * u / |u|, u ~ N(0, I) over the same parameters (a control of the same length)
   A negative s moves against the descent direction.

`--estimators` compares advantage estimators on the same rollouts by the agreement of their gradients across
batches (an estimator whose batches agree more carries more signal per sample; the cosine is scale-free, so batch
normalisation does not matter here): `grpo` (the pipeline's: (score - group mean) / group std), `rloo` (the
pipeline's: score - leave-one-out group mean), `grpo_nostd` (score - group mean, no std: Dr. GRPO, Liu et al.
2025), `rtg` (reward-to-go: A[t, b] = sum_{t' >= t} r[t', b] minus the leave-one-out group mean of the same sum
at the same t: rewards before a chunk step are not credited to it, Williams 1992 / Sutton & Barto 13.3;
the groups share reset seeds and, with ignore_terminations, run in lockstep), `success` (score = the episode's
success_once, 0/1, normalised as grpo) and `gae` (PPO's advantages as `conf=pushcube_pi0_ppo` computes them: GAE,
Schulman et al. 2016, with that conf's algorithm.gamma, gae_lambda and reward_scale on the chunk rewards, the
checkpoint's value head as the critic -- the SFT warm start, not adapted to the policy's returns as the PPO run's
critic_warmup_steps would -- the last chunk step bootstrapped from V of the final observation, then normalised over
the whole batch; `tasks.algorithms.gae`, `normalize_advantages`). `--params trained` restricts the gradients to the parameters the
update trains (learning rate > 0 by `tasks.actor.optim.param_lr`, the optimizer's rule). With 4 or more batches it
also prints the cosine of two sums of half the batches each: the agreement at twice the rollout size (1/cos - 1
halves if the noise is independent).

Prints the eval success_once of theta_0 and of every step (no eval when `--steps` is empty). Sizes: `--envs` x 10
chunk steps renders (~40-130 ms each on lavapipe) per batch; 2 x 128 envs + 6 evals of 48 episodes take ~8 min on
the 2-core machine.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.config import load_config  # noqa: E402
from tasks.algorithms import grpo_advantages  # noqa: E402
from tasks.algorithms.advantages import gae  # noqa: E402
from tasks.algorithms.losses import normalize_advantages  # noqa: E402
from tasks.algorithms.rloo import rloo_advantages  # noqa: E402
from tasks.envs import make_shard  # noqa: E402
from tasks.policies import make_policy  # noqa: E402
from tasks.prompts import instruction, policy_obs  # noqa: E402
from tasks.seeding import eval_episode_seed, rl_signal_batch_seeds  # noqa: E402
from tasks.actor.optim import param_lr  # noqa: E402

FIELDS = ("obs", "rgb", "actions", "rewards", "terminated", "truncated", "step_mask", "success")
EXTRA = "extras/"  # rollout fields of the policy's `act` extras (flow VLA: chain, denoise_idx; token VLA: tokens)
PPO_CONF = "pushcube_pi0_ppo"  # the conf whose gamma / gae_lambda / reward_scale the `gae` estimator uses


def rollout(policy, shard, instr: str, chunk_steps: int, deterministic: bool = False) -> dict[str, np.ndarray]:
    """One episode per env from a reset: the fields [T, B, ...] of FIELDS, `extras/<name>` of each of the policy's
    `act` extras (what its `evaluate` needs: the flow VLA's denoising chain and step index, the token VLA's tokens)
    and, for a policy whose `act` returns values, `values` [T + 1, B] float32 (the last: V of the final observation)."""
    shard.begin_rollout()  # auto_reset=False: every env starts a new episode (the eval shard's seeds ignore k)
    rec: dict[str, list] = {k: [] for k in FIELDS}
    for _ in range(chunk_steps):
        o, rgb = shard.current_obs(), shard.current_rgb()
        with torch.no_grad():
            out = policy.act(policy_obs(policy, o, rgb, instr), deterministic=deterministic)
        res = shard.chunk_step(out["actions"].numpy())
        for k, v in (("obs", o), ("rgb", rgb), ("actions", out["actions"].numpy()), ("rewards", res.rewards),
                     ("terminated", res.terminated), ("truncated", res.truncated), ("step_mask", res.step_mask),
                     ("success", res.success)):
            rec[k].append(v)
        for k, v in (out.get("extras") or {}).items():
            rec.setdefault(EXTRA + k, []).append(v.numpy())
        if "values" in out:
            rec.setdefault("values", []).append(out["values"].reshape(len(o), -1)[:, 0].float().numpy())
    if "values" in rec:
        with torch.no_grad():
            last = policy.values(policy_obs(policy, shard.current_obs(), shard.current_rgb(), instr))
        rec["values"].append(last.reshape(len(last), -1)[:, 0].float().numpy())
    return {k: np.stack(v) for k, v in rec.items()}


def surrogate_grad(policy, params: list[torch.nn.Parameter], batch: dict, adv: np.ndarray, instr: str,
                   chunk: int = 320) -> torch.Tensor:
    """Flat gradient (over `params`) of -mean(A * log pi) at ratio 1, token-level log-probs [N, C, D]."""
    T, B = adv.shape
    N = T * B
    keys = ("obs", "rgb", "actions", *(k for k in batch if k.startswith(EXTRA)))
    flat = {k: torch.from_numpy(batch[k].reshape(N, *batch[k].shape[2:])) for k in keys}
    extras = {k[len(EXTRA):] for k in keys if k.startswith(EXTRA)}
    a = torch.from_numpy(adv.reshape(N))
    policy.zero_grad(set_to_none=True)
    for s in range(0, N, chunk):
        i = slice(s, s + chunk)
        out = policy.evaluate(policy_obs(policy, flat["obs"][i], flat["rgb"][i], instr), flat["actions"][i],
                              {k: flat[EXTRA + k][i] for k in extras})
        lp = out["logprobs"]  # [n, C, D]
        (-(a[i][:, None, None] * lp).sum() / (N * lp[0].numel())).backward()
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params])


def estimator_advantages(name: str, batch: dict[str, np.ndarray], G: int, ppo=None) -> np.ndarray:
    """Advantages [T, B] of one estimator (module docstring) for one rollout (`rollout`'s fields, auto_reset off);
    `ppo`: the algorithm config whose gamma / gae_lambda / reward_scale `gae` uses."""
    r = torch.from_numpy(batch["rewards"]).sum(-1)  # [T, B] chunk-level rewards
    kw = dict(terminated=torch.from_numpy(batch["terminated"]), truncated=torch.from_numpy(batch["truncated"]),
              step_mask=torch.from_numpy(batch["step_mask"]), group_size=G)
    if name == "grpo":
        return grpo_advantages(rewards=r, **kw)["advantages"].numpy()
    if name == "rloo":
        return rloo_advantages(rewards=r, **kw)["advantages"].numpy()
    res = grpo_advantages(rewards=r, **kw)
    mask = res["loss_mask"].numpy().astype(np.float32)  # [T, B]
    T, B = mask.shape
    if name == "grpo_nostd":
        s = res["scores"].numpy().reshape(B // G, G)
        return ((s - s.mean(1, keepdims=True)).reshape(B)[None] * mask).astype(np.float32)
    if name == "success":
        succ = torch.zeros_like(r)
        succ[-1] = torch.from_numpy(batch["success"].any(0).astype(np.float32))  # score = success_once
        return grpo_advantages(rewards=succ, **kw)["advantages"].numpy()
    if name == "gae":
        if "values" not in batch or ppo is None:
            raise SystemExit("--estimators gae: the policy has no value head (act returned no values)")
        v = torch.from_numpy(batch["values"]).double()  # [T + 1, B]
        trunc = torch.zeros(T, B, dtype=torch.bool)
        trunc[-1] = True  # the rollout ends the episode: bootstrap from V(final obs) = v[T]
        adv, _ = gae(rewards=r.double() * ppo.reward_scale, values=v, terminated=torch.zeros_like(trunc),
                     truncated=trunc, final_values=v[1:], gamma=ppo.gamma, lam=ppo.gae_lambda)
        return normalize_advantages(adv, torch.from_numpy(mask) > 0).float().numpy()
    if name == "rtg":
        rr = (r.numpy() * mask)[::-1].cumsum(0)[::-1]  # [T, B] reward-to-go within the scored episode
        g = rr.reshape(T, B // G, G)
        loo = (g.sum(-1, keepdims=True) - g) / max(G - 1, 1)  # leave-one-out group mean at the same t
        return ((g - loo).reshape(T, B) * mask).astype(np.float32)
    raise SystemExit(f"--estimators {name}: use grpo, rloo, grpo_nostd, rtg, success or gae")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True, help="a VLA's save_pretrained directory (an SFT checkpoint's hf/); "
                    "--conf picks the family's RL conf (pushcube_token_grpo for a token VLA)")
    ap.add_argument("--conf", default="pushcube_pi0_grpo")
    ap.add_argument("--envs", type=int, default=128)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--eval-episodes", type=int, default=48)
    ap.add_argument("--steps", nargs="*", default=["sign:1e-4", "sign:2e-4", "sign:5e-4", "sgd:0.03", "sgd:0.1",
                                                    "rand:0.3"])
    ap.add_argument("--estimators", nargs="+", default=["grpo"],
                    help="advantage estimators to compare: grpo rloo grpo_nostd rtg success gae (module docstring)")
    ap.add_argument("--params", choices=("all", "trained"), default="all",
                    help="gradients over all parameters the log-probs depend on, or only those the update trains")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides KEY=VALUE")
    args = ap.parse_args(argv)
    cfg, _ = load_config([f"conf={args.conf}", f"policy.model_path={args.model_path}", *args.set], components=False)
    if cfg.policy.name not in ("pi0", "pi05", "token_vla"):
        raise SystemExit(f"policy.name={cfg.policy.name}: this benchmark measures a VLA (pi0, pi05 or token_vla)")
    torch.set_num_threads(1)
    G, T, instr = cfg.algorithm.group_size, cfg.rollout.chunk_steps, instruction(cfg)
    ppo = (load_config([f"conf={PPO_CONF}", f"policy.model_path={args.model_path}"], components=False)[0].algorithm
           if "gae" in args.estimators else None)
    probe = make_shard(cfg.env, shard=0, num_shards=1, num_envs=1, auto_reset=False, ignore_terminations=True,
                       base_seed=0)
    policy = make_policy(cfg.policy, obs_dim=probe.obs_dim, action_dim=probe.action_dim,
                         image_size=cfg.env.image_size).eval()
    probe.close()

    grads, t0 = {e: [] for e in args.estimators}, time.perf_counter()
    params = None
    for i in range(args.batches):
        torch_seed, base_seed = rl_signal_batch_seeds(cfg.env.seed, i)
        torch.manual_seed(torch_seed)
        shard = make_shard(cfg.env, shard=0, num_shards=1, num_envs=args.envs, auto_reset=False,
                           ignore_terminations=True, base_seed=base_seed, group_size=G)
        batch = rollout(policy, shard, instr, T)
        shard.close()
        if params is None:  # the parameters the log-probs depend on (not the value head, not unused LM outputs)
            surrogate_grad(policy, list(policy.parameters()), {k: v[:1, :2] for k, v in batch.items()},
                           np.ones((1, 2), np.float32), instr)
            keep = [(n, p) for n, p in policy.named_parameters() if p.grad is not None
                    and (args.params == "all" or param_lr(cfg.algorithm, n) > 0)]  # the optimizer's rule
            params, names = [p for _, p in keep], [n for n, _ in keep]
            print(f"gradients over {sum(p.numel() for p in params)} parameters ({args.params})", flush=True)
        for e in args.estimators:
            grads[e].append(surrogate_grad(policy, params, batch, estimator_advantages(e, batch, G, ppo), instr))
        print(f"batch {i}: {args.envs} envs, stochastic success_once {batch['success'].any(0).mean():.3f}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        if i == 0:  # the same reset seeds with the ODE (the eval's policy): the sampling noise's cost, paired
            shard = make_shard(cfg.env, shard=0, num_shards=1, num_envs=args.envs, auto_reset=False,
                               ignore_terminations=True, base_seed=base_seed, group_size=G)
            det = rollout(policy, shard, instr, T, deterministic=True)["success"].any(0)
            shard.close()
            sto = batch["success"].any(0)
            print(f"batch 0's reset seeds with the ODE: success_once {det.mean():.3f} (stochastic {sto.mean():.3f}; "
                  f"both {np.mean(det & sto):.3f}, ODE only {np.mean(det & ~sto):.3f}, stochastic only "
                  f"{np.mean(sto & ~det):.3f})", flush=True)
    for e, gs in grads.items():
        pairs = [(i, j) for i in range(len(gs)) for j in range(i + 1, len(gs))]
        cos = [cosine(gs[i], gs[j]) for i, j in pairs]
        m = float(np.mean(cos)) if cos else float("nan")
        ratio = f"{1 / m - 1:.2f}" if m > 0 else "n/a: no agreement"  # nan (a zero gradient) or <= 0
        line = f"{e:>10}: mean cos {m:.3f} over {len(cos)} pairs (noise/signal 1/cos-1 = {ratio})" if cos \
            else f"{e:>10}: one batch"
        if len(gs) >= 4:
            h = len(gs) // 2
            line += f"; two sums of {h} batches: cos {cosine(sum(gs[:h]), sum(gs[h:2 * h])):.3f}"
        print(line, flush=True)
        if len(gs) == 2:
            print(f"            |g0| = {float(gs[0].norm()):.4f}  |g1| = {float(gs[1].norm()):.4f}")
    g = torch.stack(grads[args.estimators[0]]).sum(0)
    sizes = [p.numel() for p in params]
    parts = torch.split(g, sizes)
    share = sorted(((float(x.norm() ** 2 / g.norm() ** 2), n, x.numel()) for x, n in zip(parts, names)), reverse=True)
    for s, n, k in share[:5]:
        print(f"  {100 * s:5.1f}% of |g|^2  {n} ({k} parameters)")
    by_module: dict[str, list] = {}  # the same shares summed per top-level module (expert, noise_head, ...)
    for s, n, k in share:
        m = by_module.setdefault(n.split(".")[0], [0.0, 0])
        m[0], m[1] = m[0] + s, m[1] + k
    print("  per module: " + ", ".join(f"{n} {100 * s:.1f}% ({k})" for n, (s, k) in
                                       sorted(by_module.items(), key=lambda x: -x[1][0])))
    if not args.steps:
        return

    ev = make_shard(cfg.env, shard=0, num_shards=1, num_envs=args.eval_episodes, auto_reset=False,
                    ignore_terminations=True, base_seed=0, seed_fn=lambda e, k: eval_episode_seed(cfg.env.eval.seed, e))
    theta0 = [p.detach().clone() for p in params]

    def set_params(vec: torch.Tensor) -> None:
        for p, p0, d in zip(params, theta0, torch.split(vec, sizes)):
            p.data.copy_(p0 + d.view_as(p))

    def evaluate() -> float:
        torch.manual_seed(0)
        return float(rollout(policy, ev, instr, T, deterministic=True)["success"].any(0).mean())

    print(f"theta_0: eval success_once {evaluate():.3f} ({args.eval_episodes} episodes)", flush=True)
    for spec in args.steps:
        kind, s = spec.split(":")
        s = float(s)
        if kind == "sign":
            step = -s * torch.sign(g)
        elif kind == "sgd":
            step = -s * g / g.norm()
        elif kind == "rand":
            u = torch.randn(g.shape, generator=torch.Generator().manual_seed(123))
            step = s * u / u.norm()
        else:
            raise SystemExit(f"--steps {spec}: use sign:S, sgd:S or rand:S")
        set_params(step)
        print(f"{spec:>12}: eval success_once {evaluate():.3f}", flush=True)
    set_params(torch.zeros_like(g))


if __name__ == "__main__":
    main()
