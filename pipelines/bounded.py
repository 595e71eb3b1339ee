"""A call with a time bound: for calls into services that may accept a request and never answer (the Dask scheduler,
a Kubernetes API server), so that the driver cannot hang on them (pipelines.runner.watcher, pipelines.clusters)."""
from __future__ import annotations

import threading


def bounded(fn, *args, timeout: float, what: str, **kwargs):
    """`fn(*args, **kwargs)` in a daemon thread, its result within `timeout` seconds.

    Raises:
        TimeoutError: naming `what` and the bound (the thread is left behind; it cannot keep the process alive).
        Whatever `fn` raises.
    """
    box: dict = {}

    def call():
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = exc

    t = threading.Thread(target=call, daemon=True, name=f"dagrl-{what[:20]}")
    t.start()
    t.join(timeout)
    if "err" in box:
        raise box["err"]
    if "out" not in box:
        raise TimeoutError(f"{what} did not answer within {timeout:.0f} s")
    return box["out"]
