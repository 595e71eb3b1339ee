"""Recovery of a run from lost and stalled workers: the Runner's watch over its placed workers.

`Recovery` is a mixin of `pipelines.runner.Runner` (it uses the runner's `cfg`, `client`, `placement`,
`_placed_ids`, `state`, `ranks`, `run_dir`, `echo`, `_init_actor`). The runner's waits go through
`_wait_or_lost` / `_fetch_or_lost`, which return the placed workers that left the cluster; `_recover` re-plans
placement on the live workers and, if the actor was lost, rolls the run back to its last checkpoint.
"""
from __future__ import annotations

import time

from pipelines.cluster import plan_placement
from storage.checkpoints import latest_checkpoint, load_checkpoint
from tasks.config import ConfigError


class Recovery:
    """Lost-worker detection and recovery, mixed into `pipelines.runner.Runner`."""

    def _worker_ids(self) -> dict[str, str]:
        """address -> worker id (a restarted worker can come back on the same address with a new id and no state)"""
        return {a: w.get("id", a) for a, w in self.client.scheduler_info(n_workers=-1)["workers"].items()}

    def _lost_workers(self) -> set[str]:
        """Placed workers gone (or restarted with a new id), confirmed by a second look 2 s later: on a starved
        machine one scheduler_info() answer was seen to list none of the workers that were still alive."""
        placed = {*self.placement.shard_workers, *self.placement.actor_workers[:self.ranks]}

        def missing() -> set[str]:
            now = self._worker_ids()
            return {a for a in placed if now.get(a) != self._placed_ids.get(a)}
        lost = missing()
        if lost:
            time.sleep(2.0)
            lost &= missing()
        return lost

    def _wait_or_lost(self, futures) -> set[str]:
        """Wait for `futures`; return the placed worker addresses that left the cluster meanwhile (empty: done).

        A task pinned to a worker that died would wait forever in `no-worker`, so the set of live workers is
        checked every second while waiting.
        """
        from distributed import wait
        while True:
            try:
                wait(futures, timeout=1.0)
                return set()
            except TimeoutError:
                lost = self._lost_workers()
                if lost:
                    return lost

    def _fetch_or_lost(self, futures) -> list | set[str]:
        """Results of finished futures, or the set of lost placed workers if fetching stalls on one."""
        out = []
        for f in futures:
            while True:
                try:
                    out.append(f.result(timeout=1.0))
                    break
                except TimeoutError:
                    lost = self._lost_workers()
                    if lost:
                        return lost
                except Exception:  # a task that failed because its worker restarted under it: retry, not fail
                    lost = self._lost_workers()
                    # a rank fails as soon as a peer's connection drops, which can be before the scheduler has
                    # seen the peer's worker go: look a little longer before calling the error the run's
                    deadline = time.monotonic() + (10.0 if self.ranks > 1 else 0.0)
                    while not lost and time.monotonic() < deadline:
                        time.sleep(1.0)
                        lost = self._lost_workers()
                    if lost:
                        return lost
                    raise
        return out

    def _busy_rank_workers(self, graph) -> set[str]:
        """Actor rank workers processing one of `graph`'s rank nodes (actor_update_r*, actor_state_r*) now."""
        if self.ranks == 1:
            return set()
        mine = {k for k in graph.layers if str(k).startswith(("actor_update_r", "actor_state_r"))}
        ranks = self.placement.actor_workers[:self.ranks]
        try:
            processing = self.client.processing()  # live workers only: a lost one is restarted anyway
        except Exception:  # noqa: BLE001 - a scheduler that cannot answer: assume the worst (restart them)
            return set(ranks)
        return {w for w, keys in processing.items() if w in ranks and mine & {str(k) for k in keys}}

    def _release_groups(self, workers: list[str], restart: set[str] = frozenset()) -> None:
        """Free the actor process groups on `workers`: restart those in `restart` (a thread blocked in a collective
        cannot be interrupted; the Nanny starts a fresh process), destroy the group on the others."""
        from tasks.distributed import release_group
        restart = [w for w in workers if w in restart]
        if restart:
            status = self.client.restart_workers(restart, timeout=120, raise_for_error=False)
            failed = [w for w, s in status.items() if s != "OK"]
            if failed:  # no nanny: the blocked rank raises after its group's timeout (distributed.DEFAULT_TIMEOUT_S)
                self.echo(f"dagrl: could not restart actor worker(s) {failed} ({status}); their ranks stay blocked "
                          f"until the process group's timeout")
        rest = [w for w in workers if w not in restart]
        if rest:
            self.client.run(release_group, self.state.run_id, workers=rest, on_error="ignore")
        self.echo(f"dagrl: actor process group (generation {self.state.actor_generation}) dropped: restarted "
                  f"{restart or 'no worker'}, released on {rest or 'no worker'}")

    def _recover(self, lost: set[str], step: int, busy: set[str] = frozenset()) -> None:
        """Re-plan placement on the live workers and drop resident env shards so that every shard is re-created
        from the step's seed cursor. If the actor's worker was lost (its weights and optimizer with it), roll the
        run back to the latest checkpoint (or to a fresh actor when there is none yet).

        Multi-rank actor: the loss of any rank's worker, or any loss while rank nodes were running (`busy`: a
        cancelled rank may be blocked in a collective, and a retry must not pair with it), breaks the group:
        the surviving rank workers are restarted (busy) or their groups destroyed, the run rolls back to the last
        checkpoint and the group is rebuilt in the next generation on a new port."""
        cfg, st = self.cfg, self.state
        ranks = self.placement.actor_workers[:self.ranks]
        actor_lost = bool(lost & set(ranks)) or bool(busy)
        self.echo(f"dagrl: worker(s) {sorted(lost)} lost during step {step}; "
                  f"{'restoring the actor from the last checkpoint and ' if actor_lost else ''}retrying")
        if actor_lost and self.ranks > 1:
            self._release_groups([w for w in ranks if w not in lost], restart=busy)
        n = cfg.cluster.num_env_workers + cfg.cluster.num_gpu_workers if cfg.cluster.address is None else 1
        self.client.wait_for_workers(n, timeout=max(120.0, cfg.cluster.connect_timeout_s))
        deadline = time.monotonic() + 120.0
        while True:
            try:
                self.placement = plan_placement(cfg, self.client)
                self._placed_ids = self._worker_ids()
                break
            except ConfigError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        from tasks import resident
        self.client.run(resident.release, f"{st.run_id}/shard/", on_error="ignore")
        if actor_lost:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is not None:
                saved = load_checkpoint(ckpt)["run"]["runner"]
                st.step, st.env_steps, st.cursors = saved["step"], saved["env_steps"], saved["cursors"]
            else:
                st.step, st.env_steps, st.cursors = 0, 0, [None] * cfg.env.num_shards
            if self.ranks > 1:
                st.actor_generation += 1
            tag = f"r{step}" + (f"-g{st.actor_generation}" if self.ranks > 1 else "")
            self.weights, _ = self._init_actor({"path": str(ckpt)} if ckpt else None, tag=tag)
