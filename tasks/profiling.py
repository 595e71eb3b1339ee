"""Run one task under torch.profiler (`runner.profile_update_step`): plain torch, no Dask, testable alone.

The graph builder (pipelines.graphs._profiled) makes a node's task `(profiled, trace_path, fn, *args)` instead of
`(fn, *args)`: the node keeps its key (and its phase in pipelines.runner.perf), its worker and its result.
"""
from __future__ import annotations

import os
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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, path)
    return out
