"""`cluster.security` (Dask TLS through to the client and the embedded cluster) and `cluster.host` /
`cluster.dashboard_address` (the embedded scheduler, dashboard and workers on 127.0.0.1 unless configured).

Certificates are made in the test: `distributed.Security.temporary()` (a self-signed key/cert pair, in memory;
needs `cryptography`, installed with distributed here) written to PEM files, used for every role."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tasks.config import Config, ConfigError, SecurityConfig, family_checks, family_class, replace_keys


@pytest.fixture(scope="module")
def pem(tmp_path_factory) -> dict[str, str]:
    """{"cert": path, "key": path} of one self-signed certificate and its key."""
    from distributed import Security
    t = Security.temporary()
    d = tmp_path_factory.mktemp("tls")
    (d / "cert.pem").write_text(t.tls_ca_file)  # temporary(): the contents, the same cert for every role
    (d / "key.pem").write_text(t.tls_client_key)
    return {"cert": str(d / "cert.pem"), "key": str(d / "key.pem")}


def _cfg(address=None, **security) -> Config:
    """A config of the embedded cluster (`address` None) or of an existing scheduler at `address`."""
    extra = {} if address is None else {"kind": "address", "address": address}
    return Config(cluster=family_class("cluster", extra.get("kind", "local"))(security=SecurityConfig(**security),
                                                                              **extra))


def _check(cfg: Config) -> None:
    """The rules of the config's cluster kind (registered with it: pipelines/clusters/checks.py)."""
    for rule in family_checks("cluster", cfg.cluster.kind):
        rule(cfg)


def _all_roles(pem) -> dict:
    return {"tls_ca_file": pem["cert"], **{f"tls_{r}_{k}": pem[k] for r in ("client", "scheduler", "worker")
                                           for k in ("cert", "key")}}


def test_embedded_cluster_binds_to_127_0_0_1_unless_configured():
    from pipelines.clusters.local import cluster_specs
    cfg = Config()
    assert (cfg.cluster.host, cfg.cluster.dashboard_address) == ("127.0.0.1", "127.0.0.1:8787")  # the defaults
    sched, workers = cluster_specs(cfg, [("gpu-0", None)])
    assert sched["options"]["host"] == "127.0.0.1" and sched["options"]["dashboard_address"] == "127.0.0.1:8787"
    assert sorted(workers) == ["env-0", "env-1", "gpu-0"]
    assert {w["options"]["host"] for w in workers.values()} == {"127.0.0.1"}
    assert "security" not in sched["options"] and all("protocol" not in w["options"] for w in workers.values())
    cfg = replace_keys(cfg, {"cluster.host": "0.0.0.0", "cluster.dashboard_address": ":8787"})
    sched, workers = cluster_specs(cfg, [("gpu-0", None)])
    assert (sched["options"]["host"], sched["options"]["dashboard_address"]) == ("0.0.0.0", ":8787")
    assert {w["options"]["host"] for w in workers.values()} == {"0.0.0.0"}


def test_security_maps_onto_distributed_security(pem):
    from pipelines.clusters import security
    from pipelines.clusters.local import cluster_specs
    assert security(_cfg()) is None  # nothing set: plain tcp://, as distributed's default
    remote = _cfg("tls://10.0.0.5:8786", tls_ca_file=pem["cert"], tls_client_cert=pem["cert"],
                  tls_client_key=pem["key"])
    _check(remote)
    s = security(remote)
    assert (s.tls_ca_file, s.tls_client_cert, s.tls_client_key) == (pem["cert"], pem["cert"], pem["key"])
    assert s.require_encryption is True and s.tls_scheduler_cert is None  # the existing scheduler has its own
    local = _cfg(**_all_roles(pem))
    _check(local)
    s = security(local)
    assert (s.tls_scheduler_cert, s.tls_scheduler_key, s.tls_worker_cert, s.tls_worker_key) == \
        (pem["cert"], pem["key"], pem["cert"], pem["key"])
    sched, workers = cluster_specs(local, [("gpu-0", None)], s)
    assert sched["options"]["protocol"] == "tls" and sched["options"]["security"] is s
    assert all(w["options"]["protocol"] == "tls" and w["options"]["security"] is s for w in workers.values())
    t = security(_cfg(temporary=True))
    assert t.require_encryption and "BEGIN CERTIFICATE" in t.tls_scheduler_cert  # in memory, every role


@pytest.mark.parametrize("address, security, key", [
    (None, {"tls_ca_file": "MISSING"}, "cluster.security.tls_ca_file"),  # no such file
    ("tls://h:8786", {"tls_ca_file": "CERT", "tls_client_key": "KEY"}, "cluster.security.tls_client_key"),  # no cert
    ("tls://h:8786", {"temporary": True}, "cluster.security.temporary"),  # per-run certs: embedded only
    ("tls://h:8786", {"tls_client_cert": "CERT"}, "cluster.security.tls_ca_file"),  # TLS to a scheduler: its CA
    ("tls://h:8786", {"tls_ca_file": "CERT"}, "cluster.security.tls_client_cert"),  # mutual TLS: a client cert
    # TLS set up, the address is not tls://
    ("tcp://h:8786", {"tls_ca_file": "CERT", "tls_client_cert": "CERT"}, "cluster.address"),
    ("tls://h:8786", {}, "cluster.address"),  # tls:// without any security
    (None, {"tls_ca_file": "CERT", "tls_client_cert": "CERT"}, "cluster.security.tls_scheduler_cert"),
    (None, {"require_encryption": True}, "cluster.security.tls_ca_file"),
    (None, {"temporary": True, "tls_ca_file": "CERT"}, "cluster.security.temporary"),
])
def test_security_errors_name_the_key(pem, address, security, key):
    files = {"MISSING": str(Path(pem["cert"]).parent / "absent.pem"), "CERT": pem["cert"], "KEY": pem["key"]}
    cfg = _cfg(address, **{k: files.get(v, v) if isinstance(v, str) else v for k, v in security.items()})
    with pytest.raises(ConfigError) as exc:
        _check(cfg)
    assert exc.value.key == key, exc.value


def test_bad_security_file_is_one_line_exit_2(pem, capsys):
    from pipelines.validate import main
    missing = str(Path(pem["cert"]).parent / "nope.pem")
    assert main(["conf=smoke", "cluster=address", "cluster.address=tls://127.0.0.1:8786",
                 f"cluster.security.tls_ca_file={missing}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1:]  # after the notes on smoke's own local-cluster keys
    assert err == [f"error: cluster.security.tls_ca_file={missing!r}: no such file; give the path of a PEM file "
                   f"(docs/guides/clusters.md, \"TLS\"; cluster.security)"]
    # the embedded cluster's keys are inert with cluster.kind=address: refused like the other local-cluster keys
    assert main(["conf=smoke", "cluster=address", "cluster.address=tls://127.0.0.1:8786",
                 f"cluster.security.tls_ca_file={pem['cert']}",
                 f"cluster.security.tls_client_cert={pem['cert']}",
                 f"cluster.security.tls_worker_cert={pem['cert']}"]) == 2
    assert "cluster.security.tls_worker_cert" in capsys.readouterr().err
    # a key of the local kind only: unknown for the address kind, the kind that has it named
    assert main(["conf=smoke", "cluster=address", "cluster.address=tcp://127.0.0.1:8786", "cluster.host=0.0.0.0"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the notes on smoke's own local-cluster keys
    assert last.startswith("error: cluster.host='0.0.0.0': unknown key for cluster.kind=address"), last
    import dataclasses

    from tasks.config.registry import families
    have = sorted(n for n, c in families("cluster").items() if "host" in {f.name for f in dataclasses.fields(c)})
    assert "local" in have and "address" not in have
    assert f"it is a key of cluster.kind={'|'.join(have)}: choose a preset of that family (" in last, last


@pytest.mark.cluster
def test_tls_embedded_cluster_and_a_tls_client(pem, capsys):
    """The embedded cluster on TLS from files (on 127.0.0.1, dashboard too), a task through it; a second client
    through `connect` with the CA and client cert (what `cluster.address=tls://...` does) runs one too; a client
    without security cannot connect; `pipelines.validate --connect` with the client's files lists the workers."""
    from pipelines.clusters import ClusterHandle, security, start_cluster
    from pipelines.clusters.address import connect
    from pipelines.config import load_config
    cfg, _ = load_config(["conf=smoke", "cluster.num_env_workers=1",
                          *(f"cluster.security.{k}={v}" for k, v in _all_roles(pem).items())])
    handle: ClusterHandle = start_cluster(cfg)
    try:
        addr = handle.client.scheduler.address
        assert addr.startswith("tls://127.0.0.1:"), addr
        assert handle.dashboard_link.startswith("http://127.0.0.1:"), handle.dashboard_link
        info = handle.client.scheduler_info(n_workers=-1)["workers"]
        assert len(info) == 2 and all(a.startswith("tls://127.0.0.1:") for a in info)
        assert handle.client.submit(sum, [1, 2, 3]).result(timeout=60) == 6
        remote = dataclasses.replace(cfg, cluster=family_class("cluster", "address")(
            address=addr, security=SecurityConfig(tls_ca_file=pem["cert"], tls_client_cert=pem["cert"],
                                                  tls_client_key=pem["key"])))
        _check(remote)
        with connect(addr, 30, security(remote)) as c2:
            assert c2.submit(pow, 2, 5).result(timeout=60) == 32
        with pytest.raises(ConnectionError):
            connect(addr, 5)  # no certificate: refused
        # pipelines.validate --connect goes through the same security
        from pipelines.validate import main
        client_tls = [f"cluster.security.tls_ca_file={pem['cert']}", f"cluster.security.tls_client_cert={pem['cert']}",
                      f"cluster.security.tls_client_key={pem['key']}"]
        assert main(["conf=smoke", "cluster=address", f"cluster.address={addr}", *client_tls, "--connect"]) == 0
        out = capsys.readouterr().out
        assert "env-0" in out and "gpu-0" in out, out
    finally:
        handle.close()
