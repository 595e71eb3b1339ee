"""What one ManiSkill camera capture costs on this machine, per `env.robot_visual_lod` and image size, and how far
the images of a decimated arm are from the original's (tasks/envs/maniskill/mesh_lod.py).

    .venv/bin/python benchmarks/render.py [--env PushCube-v1] [--sizes 32 64] [--lods 1.0 0.25 0.1 0.05] [--n 40]

For each (size, lod): one `tasks.envs.maniskill.adapter.ManiSkillEnv` (obs_mode=rgb, one env, physx_cpu; the decimated copy
is built into the cache first and its build time printed), 3 warm-up captures, then `--n` captures of the reset
state: wall ms and CPU ms (this process's user+sys time, lavapipe's threads included) per capture; then `--n`
zero-action physics steps for scale. Image distance: one episode of 12 seeded random actions with a capture every
4 steps on both the original and the decimated arm, the same states (checked bit-equal): mean |difference| in
levels (0-255) and the share of pixels off by more than 16 levels.
The CPU figures are what the machine's load changes least; the load average is printed with them.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tasks.envs.maniskill.configuration import ManiSkillEnvConfig  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(env_id: str, size: int, lod: float, n: int) -> dict:
    from tasks.envs.maniskill.adapter import ManiSkillEnv
    from tasks.envs.maniskill.mesh_lod import decimated_urdf, robot_urdf
    build_s = 0.0
    if lod < 1:
        t0 = time.perf_counter()
        decimated_urdf(robot_urdf(env_id), lod)
        build_s = time.perf_counter() - t0
    env = ManiSkillEnv(ManiSkillEnvConfig(env_id=env_id, obs_mode="rgb", image_size=size, robot_visual_lod=lod))
    env.reset(0)
    for _ in range(3):
        env.render_rgb()
    t0, c0 = time.perf_counter(), _cpu_s()
    for _ in range(n):
        env.render_rgb()
    t1, c1 = time.perf_counter(), _cpu_s()
    a = np.zeros(env.action_dim, np.float32)
    for _ in range(n):
        env.step(a)
    t2, c2 = time.perf_counter(), _cpu_s()
    rng = np.random.default_rng(0)
    states, imgs = [env.reset(4)], [env.render_rgb()]
    for t in range(12):
        states.append(env.step(rng.uniform(-1, 1, env.action_dim).astype(np.float32))[0])
        if t % 4 == 3:
            imgs.append(env.render_rgb())
    env.close()
    return {"build_s": build_s, "capture_ms": 1e3 * (t1 - t0) / n, "capture_cpu_ms": 1e3 * (c1 - c0) / n,
            "step_ms": 1e3 * (t2 - t1) / n, "step_cpu_ms": 1e3 * (c2 - c1) / n,
            "states": np.stack(states), "imgs": np.stack(imgs).astype(np.int16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="PushCube-v1")
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--lods", type=float, nargs="+", default=[1.0, 0.25, 0.1, 0.05])
    ap.add_argument("--n", type=int, default=40)
    args = ap.parse_args()
    import logging
    logging.getLogger("mani_skill").setLevel(logging.ERROR)
    print(f"{args.env}: one env per instance, physx_cpu, {args.n} captures each | load avg "
          f"{os.getloadavg()[0]:.2f} | cpus {os.cpu_count()}")
    print(f"{'px':>4} {'lod':>5} | {'capture ms':>10} {'cpu ms':>7} | {'step ms':>7} {'cpu ms':>7} | "
          f"{'build s':>7} | {'|diff| mean':>11} {'px >16':>7}")
    for size in args.sizes:
        ref = None
        for lod in sorted(args.lods, reverse=True):
            m = measure(args.env, size, lod, args.n)
            if ref is None and lod == 1.0:
                ref = m
            diff = ""
            if ref is not None and lod < 1:
                if not np.array_equal(ref["states"], m["states"]):
                    raise SystemExit(f"lod {lod}: the states differ from lod 1.0's (the dynamics changed)")
                d = np.abs(ref["imgs"] - m["imgs"])
                diff = f"{d.mean():>11.2f} {100 * (d.max(-1) > 16).mean():>6.1f}%"
            print(f"{size:>4} {lod:>5} | {m['capture_ms']:>10.1f} {m['capture_cpu_ms']:>7.1f} | "
                  f"{m['step_ms']:>7.1f} {m['step_cpu_ms']:>7.1f} | {m['build_s']:>7.1f} | {diff}", flush=True)
    print(f"load avg {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
