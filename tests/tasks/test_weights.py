"""Weight handles on a real (in-process) Dask cluster: the replica's worker receives a handle, pulls the state dict
from the actor's worker once per version, and nothing holds the tensors but the actor's worker."""
from __future__ import annotations

import pytest
import torch
from distributed import Client, LocalCluster

from tasks import resident, rollout
from tasks.config import Config, replace_key
from tasks.weights import KeyName, fetch, handle, is_handle, state_dict_nbytes
from tasks.config import check_config

RUN = "20260101-000000-w1"


def _cfg() -> Config:
    return check_config(replace_key(Config(), "policy.hidden_sizes", [8]))


def _weights(version: int) -> dict:
    from tasks.policies import make_policy
    torch.manual_seed(version)
    pol = make_policy(_cfg().policy, obs_dim=3, action_dim=2, num_values=1, image_size=None, load=False)
    return {"version": version, "state_dict": {k: v.clone() for k, v in pol.state_dict().items()},
            "metrics": {"train/x": 1.0}}


def test_handle_keeps_everything_but_the_tensors():
    w = _weights(3)
    w["optimizer"] = {"state": {}}
    h = handle(w, KeyName("actor_update-r-2"))
    assert h == {"version": 3, "metrics": {"train/x": 1.0}, "key": "actor_update-r-2",
                 "nbytes": state_dict_nbytes(w["state_dict"])}
    assert is_handle(h) and not is_handle(w)
    assert h["nbytes"] == 4 * (3 * 8 + 8 + 8 * 2 + 2 + 3 * 8 + 8 + 8 * 1 + 1 + 2)  # float32 MLP, one hidden layer
    assert fetch(w) is w["state_dict"]  # versioned weights resolve to themselves
    with pytest.raises(RuntimeError, match="inside Dask worker tasks"):
        fetch(h)


def _replica_load(cfg, h):
    """On the replica's worker: what the task received and what the replica loaded."""
    assert is_handle(h), "the rollout task must receive a handle, not the tensors"
    rep = rollout.get_replica(cfg, RUN, h, 3, 2)
    return {"sync": rep.last_sync, "sum": float(sum(v.double().sum() for v in rep.module.state_dict().values())),
            "version": rep.version}


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as c:
        yield c


def test_replica_fetches_worker_to_worker_once_per_version(client):
    a, b = sorted(client.scheduler_info()["workers"])
    cfg = _cfg()
    w0 = client.submit(_weights, 0, workers=[a], key="actor_init-w")  # the actor's weights, held on worker a
    h0 = client.submit(handle, w0, KeyName(w0.key), workers=[a], key="weights_handle-w0")
    first = client.submit(_replica_load, cfg, h0, workers=[b], key="env_step-w0-0").result()
    expected = _weights(0)
    assert first["version"] == 0
    assert first["sync"]["bytes"] == state_dict_nbytes(expected["state_dict"]) and first["sync"]["seconds"] > 0
    assert first["sum"] == pytest.approx(float(sum(v.double().sum() for v in expected["state_dict"].values())))
    # same version again: no fetch, no load
    again = client.submit(_replica_load, cfg, h0, workers=[b], key="env_step-w0-1").result()
    assert again["sync"] == {"seconds": 0.0, "bytes": 0} and again["version"] == 0
    # only the actor's worker ever held the full weights (the replica pulled them outside Dask's dependencies)
    assert client.who_has([w0]) == {w0.key: (a,)}
    # a new version: one more transfer of the same size
    w1 = client.submit(_weights, 1, workers=[a], key="actor_update-w1")
    h1 = client.submit(handle, w1, KeyName(w1.key), workers=[a], key="weights_handle-w1")
    third = client.submit(_replica_load, cfg, h1, workers=[b], key="env_step-w1-0").result()
    assert third["version"] == 1 and third["sync"]["bytes"] == first["sync"]["bytes"]
    assert client.who_has([w1]) == {w1.key: (a,)}
    # on the actor's own worker the state dict is read from memory
    local = client.submit(_replica_load, cfg, h1, workers=[a], key="policy_infer-w1").result()
    assert local["version"] == 1 and local["sync"]["bytes"] == first["sync"]["bytes"]
    resident.release("")
