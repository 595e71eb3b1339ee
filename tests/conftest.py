"""Fixtures and helpers that several test modules share (the default suite's time budget: README "Tests").

- `smoke_run` (session): ONE `conf=smoke` run (filming 1 eval episode: runner.eval_videos=1) through
  `pipelines.run.main` (its own embedded cluster), used by tests/test_end_to_end.py (what it logged, stored and
  filmed) and tests/test_vla_recipe.py (the recipe's state teacher).
- `reused_clusters` (a context manager, given as a fixture): inside it, `pipelines.cluster.start_cluster` starts each embedded-cluster layout once and
  hands the same workers to every later run of that layout (what a user does with `cluster.address`), with every
  resident object of the earlier runs dropped first, as a fresh cluster would have none.

A test session started with SIGINT ignored (a background job of a script: `pytest ... &`) gets Python's default
SIGINT handler back first: the interruption tests send real SIGINTs, to this process and to the runs they start
(which inherit an ignored SIGINT and keep ignoring it, `pipelines.cli.signal_handlers`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal

import pytest

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def _reused_clusters():
    """Within the block every `pipelines.cluster.start_cluster(cfg)` of an embedded cluster with the same
    `cfg.cluster` section and simulator as the one before returns the same running workers (another layout closes
    them and starts its own); `close()` of the handles it gives out does nothing, the block's end closes the
    cluster. A remote `cluster.address` is not touched."""
    import pipelines.cluster as pc
    from tasks import resident

    real = pc.start_cluster
    started: dict[str, pc.ClusterHandle] = {}

    class _Kept(pc.ClusterHandle):
        def close(self) -> None:  # the block's end closes the real one
            pass

    def start(cfg):
        if cfg.cluster.address:
            return real(cfg)
        key = repr((dataclasses.asdict(cfg.cluster), cfg.env.simulator))
        if key in started:  # what a new cluster starts from: no resident object of an earlier run
            started[key].client.run(resident.release, "", on_error="ignore")
        else:
            while started:  # one cluster at a time (memory): another layout closes the one before
                started.popitem()[1].close()
            started[key] = real(cfg)
        h = started[key]
        return _Kept(h.client, h.cluster, h.dashboard_link)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pc, "start_cluster", start)
        try:
            yield
        finally:
            for h in started.values():
                h.close()


@pytest.fixture(scope="session")
def reused_clusters():
    """The `_reused_clusters` context manager (a fixture: two conftest.py files make `import conftest` ambiguous)."""
    return _reused_clusters


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The run root of one `conf=smoke` run (experiment dir `smoke/`, MLflow under the root), exit code asserted.
    Its one eval (step 3, the last) films one episode although 3 is no multiple of `runner.eval_video_interval`."""
    from pipelines.run import main
    root = tmp_path_factory.mktemp("smoke_run")
    assert main(["conf=smoke", f"run_root={root}", "cluster.dashboard_address=127.0.0.1:0",
                 "runner.eval_videos=1", "runner.eval_video_interval=2"]) == 0
    return root
