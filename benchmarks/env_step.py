"""One ManiSkill CPU env's step: ManiSkill's own `env.step` against `env.fast_step` (tasks.envs.maniskill.fast_step).

    .venv/bin/python benchmarks/env_step.py [--env-id PushCube-v1] [--steps 2000] [--repeats 3] [--set KEY=VALUE ...]

Two envs of the default experiment's env config (conf/conf/pushcube_ppo.yaml + --set), one with `env.fast_step=false`,
one with the default; the same reset seeds and uniform random actions in [-1, 1], resetting on termination or
truncation. Prints the mean wall time per step of each (best of --repeats runs of --steps steps, one process, one
torch thread) and their ratio, and checks that both returned the same values at every step (it exits 1 if not).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env-id", default="PushCube-v1")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    import dataclasses
    import warnings

    import numpy as np
    import torch
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from pipelines.config import load_config
    from tasks.envs.maniskill.adapter import ManiSkillEnv
    cfg, _ = load_config([f"env.env_id={args.env_id}", *args.set], components=False)
    envs = {"ManiSkill env.step": ManiSkillEnv(dataclasses.replace(cfg.env, fast_step=False)),
            "env.fast_step": ManiSkillEnv(dataclasses.replace(cfg.env, fast_step=True))}
    if envs["env.fast_step"]._fast_step is None:
        print(f"{args.env_id} (control_mode={cfg.env.control_mode}, reward_mode={cfg.env.reward_mode}): no fast "
              f"path in tasks.envs.maniskill.fast_step; both columns would be ManiSkill's step")
        sys.exit(2)
    actions = np.random.default_rng(0).uniform(-1, 1, (args.steps, envs["env.fast_step"].action_dim)).astype(np.float32)
    best, outs = {}, {}
    for _ in range(args.repeats):
        for name, env in envs.items():
            env.reset(0)
            seed, out = 1, []
            t = time.perf_counter()
            for a in actions:
                r = env.step(a)
                out.append(r)
                if r[2] or r[3]:
                    env.reset(seed)
                    seed += 1
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
            outs[name] = out
    same = all(np.array_equal(a[0], b[0]) and a[1:] == b[1:] for a, b in zip(*outs.values()))
    ref, fast = (best[k] / args.steps * 1e6 for k in envs)
    print(f"{args.env_id}, {args.steps} steps x best of {args.repeats}, random actions, 1 torch thread:")
    print(f"  ManiSkill env.step  {ref:8.0f} us/step")
    print(f"  env.fast_step       {fast:8.0f} us/step   ({ref / fast:.2f}x)")
    print(f"  same values at every step: {'yes' if same else 'NO'}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
