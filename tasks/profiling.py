"""Measuring a process from inside it: one task under torch.profiler (`runner.profile_update_step`) and the
process's memory (pipelines.runner.perf's peak memory). Light to import (torch and psutil only inside the
functions), no Dask: testable alone.

The graph builder (pipelines.graphs._profiled) makes a node's task `(profiled, trace_path, fn, *args)` instead of
`(fn, *args)`: the node keeps its key (and its phase in pipelines.runner.perf), its worker and its result.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def profiled(trace_path: str, fn, *args):
    """`fn(*args)` under `torch.profiler.profile` (CPU activity, and CUDA when this process sees a GPU); returns
    its result and writes the profile as a Chrome trace JSON (chrome://tracing, Perfetto) to `trace_path`
    (atomically: a temporary file, then a rename; parent directories created). Times in the trace are
    microseconds, as the Chrome trace format has them."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        out = fn(*args)
    path = Path(trace_path)
    path.parent.mkdir(exist_ok=True)  # <run dir>/profile; a run dir removed under the run is not made again
    tmp = path.with_name(path.name + ".tmp")
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, path)
    return out


def process_memory() -> dict:
    """This process's memory: {"pid", "host", "peak_rss" (bytes, the kernel's high-water mark), "rss" (bytes,
    now), "gpu_peak" (bytes, torch's peak CUDA allocation over the devices; None without CUDA in use)}. Runs on
    workers (`client.run`: this module imports nothing heavy, so a worker's event loop answers at once), on the
    scheduler and on the driver (pipelines.runner.perf)."""
    import resource
    import socket

    import psutil
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    gpu = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        gpu = max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count()))
    return {"pid": os.getpid(), "host": socket.gethostname(), "peak_rss": int(peak),
            "rss": int(psutil.Process().memory_info().rss), "gpu_peak": gpu}


def scheduler_memory(dask_scheduler=None) -> dict:
    """`client.run_on_scheduler(scheduler_memory)`: the scheduler process's memory (`process_memory`) and, from
    the workers' heartbeats (Dask's worker memory metric `WorkerState.memory.process`), each worker's
    {"host", "pid", "rss" (bytes)} now."""
    from urllib.parse import urlparse
    out = process_memory()
    out["workers"] = {a: {"host": urlparse(a).hostname or a, "pid": int(ws.pid), "rss": int(ws.memory.process)}
                      for a, ws in dask_scheduler.workers.items()}
    return out
