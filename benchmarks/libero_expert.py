"""Success, episode lengths and wall time of the scripted LIBERO expert (tasks/envs/libero/expert.py) on the train
and eval init states of a few tasks (the adapter's trial split: each task's last `--eval-trials` init states are
eval, the others train).

    .venv/bin/python benchmarks/libero_expert.py [--suite libero_object] [--tasks 0 1] [--per-split 10]

Per task: the first `--per-split` trials of each split, one env (`tasks.envs.libero.adapter.LiberoEnv`, no images rendered:
the expert reads the simulator's poses) built once per task. Success is LIBERO's own check (the env's terminated =
`check_success()`), the expert never judges it. Prints one line per (task, split): successes / episodes, the Wilson
95 % interval, mean / max episode length (policy steps), seconds per episode; then the load average (the machine
may be shared).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tasks.envs.libero.configuration import LiberoEnvConfig  # noqa: E402
import tasks.envs.libero.adapter as L  # noqa: E402
from tasks.envs.libero.reset_states import split_trials  # noqa: E402
from tasks.envs.libero.expert import expert_episode  # noqa: E402
from tasks.evalstats import wilson_interval  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="libero_object")
    ap.add_argument("--tasks", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--per-split", type=int, default=10)
    ap.add_argument("--eval-trials", type=int, default=10)
    a = ap.parse_args()
    t_all = time.perf_counter()
    total = ok = steps = 0
    for t in a.tasks:
        cfg = LiberoEnvConfig(simulator="libero", env_id=a.suite, obs_mode="state", control_mode="OSC_POSE",
                              reward_mode="sparse", sim_backend="cpu", task_ids=[t], eval_trials=a.eval_trials)
        env = L.LiberoEnv(cfg)
        t0 = time.perf_counter()
        env.reset_to(t, 0)
        print(f"{a.suite} task {t} ({env.instruction!r}): env built in {time.perf_counter() - t0:.1f} s", flush=True)
        split = split_trials(len(L.init_states(a.suite, t)), "disjoint", a.eval_trials, a.per_split)
        for name, trials in split.items():
            t0 = time.perf_counter()
            res = [expert_episode(env, t, tr) for tr in trials]
            sec = (time.perf_counter() - t0) / len(trials)
            k, lens = sum(r["success"] for r in res), [r["steps"] for r in res]
            lo, hi = wilson_interval(k, len(res))
            fails = [tr for tr, r in zip(trials, res) if not r["success"]]
            print(f"  {name:5s} trials {trials[0]}..{trials[-1]}: {k}/{len(res)} = {k / len(res):.2f} "
                  f"[{lo:.2f}, {hi:.2f}], len mean {np.mean(lens):.0f} max {max(lens)}, {sec:.1f} s/episode"
                  f"{', failed trials ' + str(fails) if fails else ''}", flush=True)
            total, ok, steps = total + len(res), ok + k, steps + sum(lens)
        env.close()
    wall = time.perf_counter() - t_all
    lo, hi = wilson_interval(ok, total)
    print(f"all: {ok}/{total} = {ok / total:.2f} [{lo:.2f}, {hi:.2f}]; {total / wall * 60:.1f} episodes/min, "
          f"{steps / wall:.1f} steps/s incl. builds; wall {wall:.0f} s; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
