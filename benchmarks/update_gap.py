"""The PPO update alone: dagrl's `tasks.update.actor_update` against the hand-written loop of
`benchmarks/throughput.py` (b), on the same rollout, in one process, at 1 and 2 torch threads.

    .venv/bin/python benchmarks/update_gap.py [--num-envs 16] [--repeats 5] [--threads 1 2] [--profile]

The rollout is real: the default experiment (conf/conf/pushcube_ppo.yaml, `env.num_envs` envs in 2 shards,
T = rollout.chunk_steps chunk steps) stepped in this process with `tasks.rollout.env_step`, its GAE by
`tasks.update.advantages`. Both updates then run the config's epochs x minibatches with target_kl, from the same
initial weights, each `--repeats` times (fresh optimizer and weights each time; the figure is the minimum, the
least disturbed by other load). The hand-written loop is the one `benchmarks/throughput.py` times for system (b)
(`throughput.hand_written_ppo_update`: the same formula on the same flattened tensors, no masks, no metrics).

Printed: seconds per update and per Adam step for each (threads, system), the machine's load average, and with
`--profile` the top of a cProfile of one dagrl update (where the extra time goes).

`--dask`: also the same `actor_update` on the same samples inside the pipeline's actor worker: a one-worker
cluster built by `pipelines.cluster.cluster_specs` from the same config (the GPU worker's Nanny, its environment
variables and threads exactly as `python -m pipelines.run` starts it), the samples sent once and kept there.
Shown: the function's own `time/update` (what the pipeline logs) for the worker as configured, and for the same
worker with Dask's statistical profiler off (`distributed.worker.profile.enabled=False`).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def rollout(num_envs: int, overrides: list[str]):
    """(cfg, initial weights, [advantage dicts per shard]) of one real rollout of the default experiment."""
    import torch
    from pipelines.config import load_config
    from tasks import rollout as ro
    from tasks import update
    from tasks.envs.vulkan import ensure_vulkan
    ensure_vulkan()
    torch.set_num_threads(1)
    cfg, _ = load_config([f"env.num_envs={num_envs}", "rollout.inference=colocated", *overrides])
    dims = ro.env_dims(cfg)
    w = update.actor_init(cfg, "bench-gap", dims)
    advs = []
    for shard in range(cfg.env.num_shards):
        seg = ro.env_step(cfg, "bench-gap", shard, w, cfg.rollout.chunk_steps, None, first=True, last=True)
        advs.append(update.advantages(cfg, ro.trajectory(seg)))
    return cfg, w, advs


def in_worker(cfg, w, advs, repeats: int, profiler: bool) -> tuple[list[float], int]:
    """Sorted `time/update` of `repeats` (+1 warm-up) actor_update calls inside a fresh one-worker cluster that
    `pipelines.cluster.cluster_specs` specifies for `cfg` (its GPU worker only), and the Adam steps per call."""
    import logging
    import dask
    from distributed import Client, SpecCluster
    from pipelines.cluster import cluster_specs
    from tasks import resident, update
    scheduler, workers = cluster_specs(cfg, [("gpu-0", None)])
    workers = {k: v for k, v in workers.items() if k == "gpu-0"}
    if not profiler:
        env = workers["gpu-0"]["options"]["env"]
        env["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] = "False"
    with dask.config.set({"distributed.worker.profile.enabled": profiler}):
        with SpecCluster(scheduler=scheduler, workers=workers, silence_logs=logging.ERROR) as cluster, \
                Client(cluster) as client:
            futs = client.scatter(list(advs), workers=["gpu-0"])
            wf = client.scatter(w, workers=["gpu-0"])
            out = []
            for i in range(repeats + 1):
                client.run(resident.release, "bench-gap/actor")
                m = client.submit(update.actor_update, cfg, "bench-gap", wf, *futs, pure=False,
                                  workers=["gpu-0"]).result()["metrics"]
                if i:
                    out.append((m["time/update"], int(m["train/minibatch_updates"])))
    return sorted(t for t, _ in out), out[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dask", action="store_true", help="also time actor_update inside the pipeline's actor worker")
    args = ap.parse_args()

    import torch
    from tasks import resident
    from tasks import update
    from tasks.policies import make_policy
    from tasks.seeding import model_init_seed
    from throughput import hand_written_ppo_update  # this folder is on sys.path when run as a script
    t0 = time.perf_counter()
    cfg, w, advs = rollout(args.num_envs, args.set)
    a = cfg.algorithm
    N = sum(x["actions"].shape[0] * x["actions"].shape[1] for x in advs)
    print(f"update gap | {time.strftime('%Y-%m-%d %H:%M')} | {os.cpu_count()} cores | load avg "
          f"{os.getloadavg()[0]:.2f} | N={N} samples, {a.update_epochs} epochs x {a.num_minibatches} minibatches, "
          f"target_kl {a.target_kl} | rollout {time.perf_counter() - t0:.1f}s", flush=True)
    data = update._flatten(advs)
    O, D = data["obs"].shape[-1], data["actions"].shape[-1]

    def dagrl_once() -> tuple[float, int]:
        resident.release("bench-gap/actor")  # a fresh actor (weights w, new optimizer) each time
        t = time.perf_counter()
        out = update.actor_update(cfg, "bench-gap", w, *advs)
        return time.perf_counter() - t, int(out["metrics"]["train/minibatch_updates"])

    def base_once() -> tuple[float, int]:
        policy = make_policy(cfg.policy, obs_dim=O, action_dim=D, seed=model_init_seed(cfg.seed))
        policy.load_state_dict(w["state_dict"])
        opt = torch.optim.Adam(policy.parameters(), lr=a.lr, eps=1e-5)
        t = time.perf_counter()
        N = data["actions"].shape[0]
        logp = data["logprobs"].reshape(N, -1).sum(-1)  # the chunk's joint log-prob, as (b) stores it
        n = hand_written_ppo_update(a, policy, opt, data["obs"], data["actions"], logp,
                                    data["advantages"].reshape(N), data["returns"].reshape(N))
        return time.perf_counter() - t, n

    def thread_once() -> tuple[float, int]:  # the same call on a second thread of this process, as Dask runs tasks
        import threading
        box = []
        th_ = threading.Thread(target=lambda: box.append(dagrl_once()))
        th_.start()
        th_.join()
        return box[0]

    print(f"{'threads':>7} {'system':<28}{'update s (min)':>15}{'median':>8}{'Adam steps':>11}{'ms/step':>9}")
    for th in args.threads:
        torch.set_num_threads(th)
        for name, fn in (("hand-written loop", base_once), ("dagrl actor_update", dagrl_once),
                         ("dagrl, another thread", thread_once)):
            fn()  # warm-up
            res = [fn() for _ in range(args.repeats)]
            ts = sorted(r[0] for r in res)
            n = res[0][1]
            print(f"{th:>7} {name:<28}{ts[0]:>15.3f}{ts[len(ts) // 2]:>8.3f}{n:>11}{1000 * ts[0] / max(n, 1):>9.2f}",
                  flush=True)
    if args.dask:
        for profiler in (True, False):
            ts, n = in_worker(cfg, w, advs, args.repeats, profiler)
            print(f"{'worker':>7} {'dagrl in the actor worker' + ('' if profiler else ', no profiler'):<28}"
                  f"{ts[0]:>15.3f}{ts[len(ts) // 2]:>8.3f}{n:>11}{1000 * ts[0] / max(n, 1):>9.2f}", flush=True)
    if args.profile:
        torch.set_num_threads(1)
        pr = cProfile.Profile()
        pr.enable()
        dagrl_once()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    print(f"load avg at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
