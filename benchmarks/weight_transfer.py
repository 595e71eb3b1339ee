"""Weight transfer worker to worker: dagrl's custom path (tasks.weights.fetch) against Dask's public APIs.

```
.venv/bin/python benchmarks/weight_transfer.py                 # 10 and 100 MB, 3 repeats (~30 s)
.venv/bin/python benchmarks/weight_transfer.py --mb 10 100 400 --repeats 5
```

Two worker processes (LocalCluster, processes=True, 1 thread each, as the embedded cluster's); worker A holds a
state dict of N MB under a Dask key (as the actor's update output), worker B needs it (as a rollout replica). Each
line prints MB/s = N / seconds (median over repeats, each with a fresh key so nothing is cached):

| method | what moves | who holds a copy afterwards |
|---|---|---|
| custom (`tasks.weights.fetch`) | a task on B asks the scheduler `who_has`, pulls the value with `get_data_from_worker` (Dask's own worker-to-worker comm, `distributed.worker`, not in its documented API) | A only (B keeps it in the replica, outside Dask's memory) |
| public gather (`get_client().gather(Future(key))`) | a task on B gathers the key through its worker client (`direct_to_workers`) | A only; the worker client wants the key while the Future lives (a second who_wants on the scheduler) |
| task dependency (`submit(f, weights_future, workers=[B])`) | Dask's scheduler-planned transfer into B's `worker.data` before the task runs (timed from the driver minus an empty task's round trip) | A and B (the scheduler counts B's copy: memory on every replica worker, and it survives the step) |
| driver scatter (`gather` to the driver + `scatter(..., broadcast=True)`) | A -> driver -> B, the only public broadcast (`Client.scatter`) | the driver, A and B |

Result (2026-12-01 10:35 UTC, the shared 2-core VM under other helpers' load, `--mb 10 100 --repeats 2`):

```
method                  MB  s (median)     MB/s
custom                10.0       0.038      265
task dependency       10.0       0.030      329
driver scatter        10.0       0.065      155
custom               100.0       0.121      824
task dependency      100.0       0.085     1181
driver scatter       100.0       0.452      221
```

Why the custom path stays (tasks/weights.py): speed does not decide it. The task dependency moves the bytes over the
same comm at the same speed (within this machine's noise; its time is a difference of two driver round trips), but
leaves a full copy in every replica worker's managed memory that the scheduler keeps and counts (memory limits,
spilling) for as long as the weights' key lives; the driver scatter is 2-4x slower (two hops) and puts the full
weights in the driver, which the design keeps free of them. The public gather from inside a task
(`worker_client().gather(Future(key))`, `--methods "public gather"`) did not return within 150 s for a 1 MB key on
distributed 2026.8.0 here (a Future created by key on a worker client); it is left out of the default run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# the repo root, not benchmarks/ (whose distributed.py would shadow the `distributed` package)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _weights(nbytes: int, i: int) -> dict:
    import torch
    return {"version": i, "state_dict": {"w": torch.full((nbytes // 4,), float(i))}}


def _custom(h: dict) -> float:
    from tasks.weights import fetch
    t0 = time.perf_counter()
    sd = fetch(h)
    dt = time.perf_counter() - t0
    assert sd["w"].numel() * 4 == h["nbytes"]
    return dt


def _public(key: str, nbytes: int) -> float:
    from distributed import Future, worker_client
    with worker_client() as client:  # secedes from the worker's thread pool while it waits
        t0 = time.perf_counter()
        fut = Future(key, client)
        value = client.gather(fut, direct=True)
        dt = time.perf_counter() - t0
        assert value["state_dict"]["w"].numel() * 4 == nbytes
        del fut
    return dt


def _dep(weights: dict) -> int:
    return int(weights["version"])


def _noop(x: int) -> int:
    return x


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[10, 100])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--verbose", action="store_true", help="print every transfer")
    ap.add_argument("--methods", nargs="+", default=["custom", "task dependency", "driver scatter"],
                    help="also 'public gather' (hung on distributed 2026.8.0 here: see the module docstring)")
    args = ap.parse_args(argv)
    from distributed import Client, LocalCluster

    from tasks.weights import KeyName, handle
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0",
                      memory_limit=0) as cluster, Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        print(f"{'method':<18} {'MB':>7} {'s (median)':>11} {'MB/s':>8}")
        n = 0
        for mb in args.mb:
            nbytes = int(mb * 1e6) // 4 * 4
            times: dict[str, list[float]] = {m: [] for m in args.methods}
            for _ in range(args.repeats):
                for method in times:
                    n += 1
                    w = client.submit(_weights, nbytes, n, workers=[a], key=f"actor_update-bench-{n}")
                    h = client.submit(handle, w, KeyName(w.key), workers=[a], key=f"weights_handle-bench-{n}")
                    h.result()
                    if method == "custom":
                        dt = client.submit(_custom, h, workers=[b], pure=False).result()
                    elif method == "public gather":
                        dt = client.submit(_public, w.key, nbytes, workers=[b], pure=False).result()
                    elif method == "task dependency":
                        t0 = time.perf_counter()
                        client.submit(_noop, n, workers=[b], pure=False).result()
                        base = time.perf_counter() - t0
                        t0 = time.perf_counter()
                        client.submit(_dep, w, workers=[b], pure=False).result()
                        dt = max(time.perf_counter() - t0 - base, 1e-9)
                    else:
                        t0 = time.perf_counter()
                        value = w.result()
                        s = client.scatter(value, workers=[b], broadcast=True)
                        dt = time.perf_counter() - t0
                        del s, value
                    times[method].append(dt)
                    if args.verbose:
                        print(f"  {method}: {nbytes / 1e6:.1f} MB in {dt:.3f} s", flush=True)
                    del w, h
            for method, ts in times.items():
                med = statistics.median(ts)
                print(f"{method:<18} {nbytes / 1e6:>7.1f} {med:>11.3f} {nbytes / 1e6 / med:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
