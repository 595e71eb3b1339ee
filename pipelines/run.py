"""Entry point: `python -m pipelines.run [conf=NAME] [key=value ...]`.

Composes the Hydra config (conf/config.yaml + conf/conf/NAME.yaml + overrides), validates it completely before any
worker starts, starts the local Dask cluster (or connects to `cluster.address`), prints the dashboard link, and
trains. Exit codes: 0 done, 2 bad config or cluster (one line on stderr, nothing written), 1 a failure during
training, 130 interrupted.

Extra flags: `--show` prints the resolved config and exits.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("mani_skill", "mani_skill ", "distributed", "alembic", "mlflow"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet()
    from pipelines.config import load_config, to_yaml
    from tasks.config import ConfigError
    from tasks.envs.vulkan import VulkanMissingError

    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    show = "--show" in argv
    overrides = [a for a in argv if a != "--show"]
    try:
        cfg, _ = load_config(overrides, command="run")  # the one check path (pipelines.validate runs the same)
    except (ConfigError, VulkanMissingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if show:
        print(to_yaml(cfg))
        return 0
    return with_cluster(cfg, lambda handle: _train(cfg, handle))


def with_cluster(cfg, body) -> int:
    """Start the cluster of `cfg`, run `body(handle) -> exit code`, close the cluster. Exit 2 for a cluster that
    cannot start or a ConfigError raised by `body` (one line on stderr), 130 when interrupted (SIGTERM too)."""
    import signal
    from pipelines.cluster import start_cluster
    from tasks.config import ConfigError
    from tasks.envs.vulkan import VulkanMissingError
    try:
        handle = start_cluster(cfg)
    except (ConnectionError, ConfigError, VulkanMissingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def _term(signum, frame):  # SIGTERM (timeout, kill, schedulers) ends the run like Ctrl-C: MLflow run KILLED
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        return body(handle)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        handle.close()


def _train(cfg, handle) -> int:
    from pipelines.runner import Runner
    print(f"dagrl: experiment {cfg.experiment} | dashboard {handle.dashboard_link}", flush=True)
    runner = Runner(cfg, handle)
    print(f"dagrl: run {runner.state.run_id} | run dir {runner.run_dir} | MLflow {runner.tracking_uri} "
          f"(run {runner.tracker.run_id})", flush=True)
    res = runner.run()
    ev = res.last_eval
    print(f"dagrl: done: {res.steps} steps, {res.env_steps} env steps in {res.wall_s:.0f}s | "
          f"eval success_once {ev.get('eval/success_once', float('nan')):.3f} "
          f"success_at_end {ev.get('eval/success_at_end', float('nan')):.3f} over "
          f"{ev.get('eval/num_episodes', 0):.0f} episodes (best success_once "
          f"{runner.state.best_eval_success_once:.3f} at step {runner.state.best_eval_step}) | "
          f"peak memory {res.peak_rss_gb:.2f} GiB")
    print(f"dagrl: trajectories {res.store_path} | view: mlflow ui --backend-store-uri {res.tracking_uri}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
