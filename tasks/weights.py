"""Versioned weights between the actor and the rollout replicas: handles, worker-to-worker fetch, sync accounting.

How weights travel (pipelines.graphs wires it; README "Weight sync"):
- The actor's init or update node returns `{"version", "state_dict", ...}` on the actor's worker. The runner keeps
  only its Future, so the tensors stay in that worker's memory: nothing full ever passes through the scheduler or
  the driver.
- A `weights_handle` node pinned to the actor's worker turns those weights into a handle (`handle`): the version,
  the Dask key of the full weights and their size, no tensors. Rollout nodes (`env_step`, `policy_infer`,
  `eval`) depend on the handle only, so Dask ships a few hundred bytes to them.
- A replica whose version differs resolves the handle itself (`fetch`): it asks the scheduler which worker holds
  the key (`who_has`, key names only) and pulls the state dict from that worker directly (the `get_data` comm
  Dask's own worker-to-worker transfers use), or reads it from its own memory when it is that worker. A replica
  that already holds the version transfers nothing: a version is loaded once per replica.

Scaling to multi-GB models: with R FSDP ranks each rank holds 1/R of the parameters; the handle would list one
key per rank (each rank's node returns its local shards) and a replica pulls the R shards from the R actor
workers in parallel (R times one link's bandwidth), so no process ever serialises the whole model twice and the
scheduler still sees only key names. Today the multi-rank update gathers the full state dict on rank 0 (one key),
which is the R = 1 path above (with frozen parameters only the trainable tensors are gathered and shipped:
partial weights below); GPU-resident replicas would instead receive the shards by an NCCL broadcast
inside a rollout/actor process group (RLinf, verl), with the handle as the version check.

Why not a Dask public API: `benchmarks/weight_transfer.py` measures the custom pull against a task dependency
(same speed, but a managed copy of the full weights on every replica worker) and a driver scatter (2-4x slower,
the weights through the driver); see its docstring for the numbers.

Partial weights (only the trainable tensors): when the actor's policy has frozen parameters (LoRA, `policy.freeze`)
and says what an update can change (the policy capability `sync_state()` -> the trainable tensors, None when nothing
is frozen; `load_sync_state(state)` loads them into a replica), an update's output is
`{"version", "state_dict": <trainable tensors>, "partial": True, "base_key"}`: `base_key` is the Dask key of the run's
initial full weights (the init graph's `actor_init`, which the runner's scheduler keeps alive for the run). A replica
(`load_into`) loads the base when its key differs from the one it holds (a first load, a re-initialised actor), then
the partial state on top; frozen tensors never change, so base + the newest partial state equal the actor's full
weights. With R FSDP ranks rank 0's update output is the same partial weights (tasks.actor.distributed.
sync_weights_rank gathers only the trainable tensors from the shards), on top of the generation's init weights
(the init graph's `weights` node, whose key the runner passes to the ranks in their group spec, `base_key`, and
keeps alive). Initial weights, eval weights (the average), checkpoints and exports stay full.

Accounting: `get_replica` (tasks.rollout) times each load (fetch + `load_state_dict`) and counts its bytes
(`state_dict_nbytes`); rollout nodes report them as `weight_sync` = {"seconds", "bytes"} and the step's metrics
hold `time/weight_sync` (the slowest worker's load, s) and `system/weight_sync_mb` (MB loaded into replicas in the
step, 0 when every replica already held the version).
"""
from __future__ import annotations

import asyncio
import time

import torch


def state_dict_nbytes(state_dict: dict) -> int:
    """Bytes of the tensors of a state dict (numel * element size; non-tensors count 0)."""
    return int(sum(v.numel() * v.element_size() for v in state_dict.values() if isinstance(v, torch.Tensor)))


class KeyName:
    """A Dask key carried as data (a plain string argument equal to a key would be replaced by its value)."""

    def __init__(self, key: str):
        self.key = key

    def __repr__(self) -> str:
        return f"KeyName({self.key!r})"


def handle(weights: dict, key: "KeyName | str") -> dict:
    """A handle of versioned weights held under Dask key `key`: every entry of `weights` except the tensors
    (`state_dict`, `optimizer`), plus `key` and `nbytes` (of the state dict). Runs where the weights are (the
    actor's worker), so building it moves no tensors."""
    out = {k: v for k, v in weights.items() if k not in ("state_dict", "optimizer")}
    out["key"] = key.key if isinstance(key, KeyName) else key
    out["nbytes"] = state_dict_nbytes(weights.get("state_dict") or {})
    return out


def is_handle(weights: dict) -> bool:
    return "state_dict" not in weights and "key" in weights


def fetch(weights: dict, timeout_s: float = 120.0) -> dict:
    """The state dict of versioned weights: `weights["state_dict"]`, or, for a handle, fetched from the worker
    holding `weights["key"]` (this worker's memory when it holds it, else worker to worker).

    Raises:
        RuntimeError: a handle resolved outside a Dask worker task, or no worker holds the key within `timeout_s`
            (its holder was lost: the runner's recovery re-creates the actor and retries the step).
    """
    if not is_handle(weights):
        return weights["state_dict"]
    from distributed import get_worker
    try:
        get_worker()
    except ValueError:
        raise RuntimeError(f"weights handle of {weights['key']!r}: handles resolve inside Dask worker tasks only; "
                           f"pass {{'version', 'state_dict'}} when calling rollout tasks directly") from None
    return fetch_key(weights["key"], timeout_s)["state_dict"]


def fetch_key(key: str, timeout_s: float = 120.0) -> dict:
    """The versioned weights held under Dask key `key` (this worker's memory when it holds them, else pulled worker
    to worker); inside a Dask worker task only.

    Raises:
        RuntimeError: called outside a Dask worker task, or no worker holds the key within `timeout_s`.
    """
    from distributed import get_worker
    try:
        worker = get_worker()
    except ValueError:
        raise RuntimeError(f"weights {key!r}: keys resolve inside Dask worker tasks only") from None
    if key in worker.data:  # the actor's own worker (colocated replica, policy_infer): no transfer
        return worker.data[key]
    from distributed.utils import sync
    return sync(worker.loop, _pull, worker, key, timeout_s)


def partial(version, state_dict: dict, base_key: str) -> dict:
    """Partial versioned weights (module docstring): the trainable tensors `state_dict` of weight version
    `version`, to be loaded on top of the full weights held under Dask key `base_key`."""
    return {"version": version, "state_dict": state_dict, "partial": True, "base_key": base_key}


def load_into(module: torch.nn.Module, weights: dict, held_base: str | None) -> tuple[int, str | None]:
    """Load versioned weights (or a handle of them) into a replica's `module`, which holds the base weights of key
    `held_base` (None: none known). Full weights: `load_state_dict` (strict). Partial weights: the base first when
    `held_base` differs from `weights["base_key"]`, then `module.load_sync_state(state)`.
    Returns (bytes loaded: the state dicts' tensors, the base key the module now holds: a full load from a handle
    holds its own key, from a plain dict None).

    Raises:
        RuntimeError: as `fetch` (a handle's holder lost); torch's on a state dict that does not fit.
        KeyError / ValueError: a partial state that is not the module's (its `load_sync_state`).
    """
    sd = fetch(weights)
    nbytes = state_dict_nbytes(sd)
    if not weights.get("partial"):
        module.load_state_dict(sd)
        return nbytes, weights.get("key") if is_handle(weights) else None
    base = weights["base_key"]
    if held_base != base:
        full = fetch_key(base)["state_dict"]
        module.load_state_dict(full)
        nbytes += state_dict_nbytes(full)
    module.load_sync_state(sd)
    return nbytes, base


async def _pull(worker, key: str, timeout_s: float):
    """The value of `key` from a worker holding it (scheduler's `who_has`, then a direct `get_data`)."""
    from distributed.worker import get_data_from_worker
    deadline = time.monotonic() + timeout_s
    while True:
        holders = (await worker.scheduler.who_has(keys=[key])).get(key) or []
        for addr in holders:
            try:
                resp = await get_data_from_worker(worker.rpc, [key], addr, who=worker.address)
            except OSError:  # the holder left; ask again
                continue
            if resp.get("status") == "OK" and key in resp.get("data", {}):
                return resp["data"][key]
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker holds the weights {key!r} (holders {holders}) after {timeout_s:.0f} s: "
                               f"the actor's worker was lost or the weights were released")
        await asyncio.sleep(0.05)  # a busy holder (too many transfers) or a key not yet registered
