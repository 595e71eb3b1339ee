"""LIBERO env costs on this machine: build time, memory per env, reset times, steps/s with and without rendering,
and the settle of a task's stored init states (the reason for the MuJoCo pin, README "LIBERO").

    .venv/bin/python benchmarks/libero_env.py [--suite libero_spatial] [--task 5] [--size 128] [--steps 100]
                                              [--settle]

One process, `tasks.envs.libero.adapter.LiberoEnv` instances as the shards build them (EGL on Mesa's llvmpipe here):
- build s: the first reset of an instance (robosuite model from the task's BDDL, render context) minus a soft reset;
- memory: RSS of this process (psutil) before any env, after the first env's first render, after a second env;
- reset: a hard reset (robosuite `hard_reset=True`: a new model) vs the adapter's soft reset, each + set_init_state
  + `num_steps_wait` settle steps;
- steps/s: `--steps` uniform random actions without images; then with the agentview rendered after every action
  (`render_rgb` at --size px) and once per chunk of 5 actions (what a shard with `policy.num_action_chunks=5` does);
- `--settle`: for every stored init state of the task: after the settle steps, the rotation (deg) of every free
  object from its stored pose and its speed (m/s); prints the largest of each over the objects and init states.
The machine may be shared: the load average is printed with the figures.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from tasks.envs.libero.configuration import LiberoEnvConfig  # noqa: E402
import tasks.envs.libero.adapter as L  # noqa: E402


def rss_gib() -> float:
    return psutil.Process().memory_info().rss / 2 ** 30


def settle(env: L.LiberoEnv, task: int) -> tuple[dict[str, float], float, dict[str, int]]:
    """Per free object: its largest rotation (deg) between the stored init pose and its pose after the settle
    steps over the task's init states, the init state where it was largest; and the largest speed (m/s) then."""
    inner = env.env.env
    rot_max: dict[str, float] = {}
    worst: dict[str, int] = {}
    speed_max = 0.0
    for k in range(len(env.init)):
        env.reset_to(task, k)
        sim = inner.sim
        for name, obj in inner.objects_dict.items():
            if not obj.joints:
                continue
            jid = sim.model.joint_name2id(obj.joints[0])
            if sim.model.jnt_type[jid] != 0:  # free joints only
                continue
            adr = sim.model.jnt_qposadr[jid]
            q0 = env.init[k][1 + adr + 3:1 + adr + 7]  # flat state = [time, qpos, qvel]; free joint: pos, wxyz
            q1 = sim.data.qpos[adr + 3:adr + 7]
            rot = float(np.degrees(2 * np.arccos(np.clip(abs(np.dot(q0, q1)) / np.linalg.norm(q0) / np.linalg.norm(q1),
                                                         -1, 1))))
            speed = float(np.linalg.norm(sim.data.qvel[sim.model.jnt_dofadr[jid]:sim.model.jnt_dofadr[jid] + 3]))
            if rot >= rot_max.get(name, -1.0):
                rot_max[name], worst[name] = rot, k
            speed_max = max(speed_max, speed)
    return rot_max, speed_max, worst


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="libero_spatial")
    ap.add_argument("--task", type=int, default=5)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--settle", action="store_true")
    a = ap.parse_args(argv)
    cfg = LiberoEnvConfig(simulator="libero", env_id=a.suite, obs_mode="rgb", image_size=a.size,
                          control_mode="OSC_POSE", reward_mode="sparse", sim_backend="cpu", task_ids=[a.task])
    import mujoco
    print(f"LIBERO {a.suite} task {a.task} ({L.suite(a.suite).get_task(a.task).language}), mujoco "
          f"{mujoco.__version__}, {a.size} px, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    m0 = rss_gib()
    env = L.LiberoEnv(cfg)
    t = time.perf_counter()
    env.reset_to(a.task, 0)
    first = time.perf_counter() - t
    env.render_rgb()
    m1 = rss_gib()
    t = time.perf_counter()
    env.reset_to(a.task, 1)
    soft = time.perf_counter() - t
    inner = env.env.env
    inner.hard_reset = True
    t = time.perf_counter()
    env.reset_to(a.task, 1)
    hard = time.perf_counter() - t
    inner.hard_reset = False
    print(f"build {first - soft:.1f} s (first reset {first:.1f} s); reset + set_init_state + {cfg.num_steps_wait} "
          f"settle steps: hard {hard:.2f} s, soft {soft:.3f} s")
    rng = np.random.default_rng(0)
    acts = rng.uniform(-1, 1, (a.steps, 7)).astype(np.float32)

    def rate(render_every: int) -> float:
        env.reset_to(a.task, 2)
        t0 = time.perf_counter()
        for i, act in enumerate(acts):
            env.step(act)
            if render_every and (i + 1) % render_every == 0:
                env.render_rgb()
        return a.steps / (time.perf_counter() - t0)
    print(f"steps/s: {rate(0):.1f} without images, {rate(5):.1f} rendering once per 5-action chunk, "
          f"{rate(1):.1f} rendering every step")
    env2 = L.LiberoEnv(cfg)
    env2.reset_to(a.task, 0)
    env2.render_rgb()
    m2 = rss_gib()
    print(f"memory (RSS): process {m0:.2f} GiB, first env +{m1 - m0:.2f} GiB, second env +{m2 - m1:.2f} GiB")
    env2.close()
    if a.settle:
        t = time.perf_counter()
        rot, speed, worst = settle(env, a.task)
        per = ", ".join(f"{n} {r:.1f} deg (init state {worst[n]})" for n, r in rot.items())
        print(f"settle of {len(env.init)} init states ({time.perf_counter() - t:.0f} s) after {cfg.num_steps_wait} "
              f"settle steps: largest rotation from the stored pose per object: {per}; largest object speed "
              f"{speed:.3f} m/s")
    env.close()


if __name__ == "__main__":
    main()
