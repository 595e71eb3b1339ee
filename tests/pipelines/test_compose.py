"""docker-compose.yml proven without Docker: the file is parsed (yaml.safe_load) and every
service's `command` runs as a local process -- the Dask scheduler, the env workers, the GPU worker, the MLflow
server -- and then the driver's command (`conf=smoke` appended) against them. So the file cannot drift from what
works: a service the test cannot map fails the test.

What is mapped, and nothing else (`Compose.localize`):
  * hosts: a service's `--host 0.0.0.0` -> 127.0.0.1; `SERVICE:PORT` in an address (tcp://scheduler:8786,
    http://mlflow:5000) -> 127.0.0.1 and an ephemeral port for that (service, port); `--port P` and
    `--dashboard-address :P` of the service itself -> its ephemeral port; a service's own healthcheck reaching
    127.0.0.1:P / localhost:P -> its ephemeral port;
  * paths: the image's files (the Dockerfile's WORKDIR /dagrl holds the repository: `COPY . .`) are this checkout,
    so its ENV (PATH, VK_ICD_FILENAMES, ...) is applied with /dagrl -> the checkout, and the installed project is
    the checkout on PYTHONPATH; every process runs in ROOT/dagrl (ROOT a tmp dir standing in for the containers'
    /), so the mounts (./runs:/dagrl/runs, the named volume at /mlartifacts) are ROOT/<container path>, one
    directory shared by every service. Since that sharing is wider than compose's (a service without the mount
    would still see the files), the test checks that every worker mounts the driver's run directory;
  * the ONE substitution: there is no PostgreSQL here, so the `postgres` service (an image without a command) does
    not run, and the MLflow server's `--backend-store-uri postgresql://USER:PASSWORD@postgres:5432/DB` -- checked
    against the postgres service's POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB -- becomes a sqlite file in
    ROOT, on the parsed command.
The server's `--allowed-hosts` is checked as the driver's container would meet it: a request with the Host header
`mlflow:5000` is answered, one with another host is refused (403).

It is also THE local tracking-server test: the `mlflow` service is a local `mlflow server` bound
to 127.0.0.1 on an ephemeral port with a database backend (sqlite here) and a served artifact store, and the smoke
run against it logs what the embedded sqlite default logs (the flattened resolved config as params, every step's
and eval's metrics, config.yaml as an artifact in the server's store, nothing in run_root/mlflow.db), and a resume
(`runner.resume=latest`, one more step) continues the timeline there as in sqlite (storage.tracking).

In the default suite; its measured time is on benchmarks/results/suite_timings.md (about a third of it the MLflow
server's start-up).
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
SUBSTITUTED = "postgres"  # the one service that does not run here (its database becomes a sqlite file)
START_TIMEOUT_S = 300  # processes on the loaded 2-core machine (the MLflow server alone took over a minute)
DRIVER_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(command) -> list[str]:
    """A compose `command` (a string, split like a shell; or a list) -> argv."""
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _dockerfile() -> tuple[str, dict[str, str]]:
    """(WORKDIR, ENV) of the Dockerfile (ENV as `K=V K2=V2` lines, $PATH-style references kept)."""
    workdir, env = "/", {}
    for line in DOCKERFILE.read_text().splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "WORKDIR":
            workdir = rest.strip()
        elif word == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                env[k] = v
    return workdir, env


class Compose:
    """The parsed compose file and its mapping onto local processes (module docstring)."""

    def __init__(self, root: Path):
        self.spec = yaml.safe_load(COMPOSE.read_text())
        self.services: dict = self.spec["services"]
        self.root = root
        self.workdir, self.image_env = _dockerfile()
        self.ports: dict[tuple[str, int], int] = {}
        self.sqlite = root / "mlflow.db"

    def port(self, service: str, port: int) -> int:
        if service not in self.services:
            pytest.fail(f"docker-compose.yml refers to {service}:{port}, and there is no service {service!r}")
        return self.ports.setdefault((service, int(port)), _free_port())

    def container_path(self, path: str) -> str:
        """A path inside a container -> ROOT/path (relative paths: against the WORKDIR)."""
        return str(self.root / Path(self.workdir, path).relative_to("/"))

    def mounts(self, name: str) -> list[tuple[str, str]]:
        """(source, container path) of a service's volumes."""
        out = []
        for v in self.services[name].get("volumes", []):
            src, _, dst = str(v).partition(":")
            out.append((src, dst.split(":")[0]))
        return out

    def _postgres_to_sqlite(self, uri: str) -> str:
        m = re.fullmatch(r"postgresql(?:\+\w+)?://([^:@]+):([^@]+)@([\w-]+):(\d+)/(\w+)", uri)
        if not m:
            pytest.fail(f"mlflow --backend-store-uri {uri!r} is not postgresql://USER:PASSWORD@HOST:PORT/DB")
        user, password, host, _, db = m.groups()
        pg = self.services.get(host)
        if pg is None or host != SUBSTITUTED:
            pytest.fail(f"the backend store's host {host!r} is not the {SUBSTITUTED!r} service")
        env = pg.get("environment", {})
        have = (env.get("POSTGRES_USER"), env.get("POSTGRES_PASSWORD"), env.get("POSTGRES_DB"))
        assert have == (user, password, db), f"the backend store {uri} does not match the postgres service: {env}"
        return f"sqlite:///{self.sqlite}"

    def localize(self, name: str, words: list[str]) -> list[str]:
        """A service's argv (or healthcheck argv) with hosts, ports and paths mapped (module docstring). Fails the
        test for a service host it cannot map."""
        out, i = [], 0
        while i < len(words):
            w = words[i]
            nxt = words[i + 1] if i + 1 < len(words) else None
            if w == "--host" and nxt is not None:
                assert nxt in ("0.0.0.0", "::"), f"{name}: --host {nxt}: a container must listen on all interfaces"
                out += [w, "127.0.0.1"]
                i += 2
                continue
            if w == "--port" and nxt is not None:
                out += [w, str(self.port(name, int(nxt)))]
                i += 2
                continue
            if w == "--dashboard-address" and nxt is not None:
                out += [w, f"127.0.0.1:{self.port(name, int(nxt.rsplit(':', 1)[1]))}"]
                i += 2
                continue
            if w == "--backend-store-uri" and nxt is not None and nxt.startswith("postgresql"):
                out += [w, self._postgres_to_sqlite(nxt)]  # the one substitution
                i += 2
                continue
            out.append(self._map_word(name, w))
            i += 1
        return out

    def _map_word(self, name: str, w: str) -> str:
        # own service reached as localhost inside its container (its healthcheck)
        w = re.sub(r"\b(?:127\.0\.0\.1|localhost):(\d+)", lambda m: f"127.0.0.1:{self.port(name, int(m.group(1)))}", w)
        # another service by its compose name
        names = "|".join(re.escape(s) for s in sorted(self.services, key=len, reverse=True))
        def service(m):  # scheme://HOST:PORT: HOST must be a service (or the container itself, mapped above)
            host, port = m.group(1), int(m.group(2))
            return m.group(0) if host == "127.0.0.1" else f"127.0.0.1:{self.port(host, port)}"
        w = re.sub(r"(?<=//)([\w.-]+):(\d+)", service, w)
        for _, dst in self.mounts(name):  # a path on a mount (bare, or the value of key=PATH / --opt=PATH)
            w = re.sub(rf"(^|=){re.escape(dst)}(?=/|$)", lambda m: m.group(1) + self.container_path(dst), w)
        left = re.search(rf"(?:^|[/@=,\s])({names}):\d", w)  # a service host left over
        if left:
            pytest.fail(f"service {name}: cannot map {left.group(0)!r} in {w!r} to a local process")
        return w

    def env(self, name: str) -> dict[str, str]:
        """os.environ + the Dockerfile's ENV (/dagrl -> this checkout) + the service's `environment`, with the
        checkout on PYTHONPATH (the image's installed project)."""
        env = dict(os.environ)
        for k, v in self.image_env.items():
            v = v.replace(self.workdir.rstrip("/") + "/", str(REPO) + "/")
            env[k] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), v)
        svc_env = self.services[name].get("environment", {})
        if isinstance(svc_env, list):
            svc_env = dict(e.split("=", 1) for e in svc_env)
        env.update({k: self._map_word(name, str(v)) for k, v in svc_env.items()})
        env["PYTHONPATH"] = str(REPO)
        return env

    def order(self) -> list[str]:
        """Services in depends_on order."""
        done: list[str] = []

        def visit(n: str, path: tuple = ()) -> None:
            assert n not in path, f"depends_on cycle {path + (n,)}"
            if n in done:
                return
            for d in self.depends_on(n):
                visit(d, path + (n,))
            done.append(n)
        for n in self.services:
            visit(n)
        return done

    def depends_on(self, name: str) -> dict[str, str]:
        """dependency -> condition (short form: service_started)."""
        d = self.services[name].get("depends_on", {})
        return {x: "service_started" for x in d} if isinstance(d, list) else \
            {k: (v or {}).get("condition", "service_started") for k, v in d.items()}


def _role(name: str, svc: dict) -> str:
    """What a service is, from its command: scheduler | worker | mlflow | driver | substituted. Anything else
    fails the test (the file has a service the test does not know how to run)."""
    if name == SUBSTITUTED:
        assert "command" not in svc and str(svc.get("image", "")).startswith("postgres"), \
            f"{name}: expected the official postgres image, as the test's sqlite substitution assumes"
        return "substituted"
    if "command" not in svc:
        pytest.fail(f"service {name} has no command: the test cannot run it as a local process")
    argv = _argv(svc["command"])
    if argv[:2] == ["dask", "scheduler"]:
        return "scheduler"
    if argv[:2] == ["dask", "worker"]:
        return "worker"
    if argv[:2] == ["mlflow", "server"]:
        return "mlflow"
    if argv[:3] == ["python", "-m", "pipelines.run"]:
        return "driver"
    pytest.fail(f"service {name}: command {svc['command']!r} is none the test knows how to run locally")


def _listen_ports(svc: dict) -> set[int]:
    argv = _argv(svc.get("command", []))
    ports = {int(argv[i + 1]) for i, w in enumerate(argv[:-1]) if w == "--port"}
    return ports | {int(argv[i + 1].rsplit(":", 1)[1]) for i, w in enumerate(argv[:-1]) if w == "--dashboard-address"}


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (a nanny's worker, the server's uvicorn workers), SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _wait(what: str, ok, procs: dict, logs: Path, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        for n, p in procs.items():
            if p.poll() is not None:
                pytest.fail(f"service {n} exited {p.returncode} while waiting for {what}: "
                            f"{(logs / f'{n}.log').read_text()[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.5)


def _get(url: str, host: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_compose_file_is_consistent():
    """Offline, no process: every service is one the test runs (or the substituted database), published ports are
    ports its command listens on, and every worker mounts the driver's run directory (checkpoints come from the
    actor worker, trajectories from the env workers)."""
    c = Compose(Path("/nonexistent"))
    roles = {n: _role(n, s) for n, s in c.services.items()}
    assert sorted(set(roles.values())) == ["driver", "mlflow", "scheduler", "substituted", "worker"], roles
    for n, s in c.services.items():
        for p in s.get("ports", []):
            container = int(str(p).rsplit(":", 1)[1])
            assert container in _listen_ports(s), f"{n} publishes {p}, its command does not listen on {container}"
            # HOST_IP:HOST_PORT:CONTAINER_PORT with the loopback address: a bare "PORT:PORT" publishes on every
            # interface (the scheduler runs what any client sends; the MLflow server has no authentication)
            assert str(p).count(":") == 2 and str(p).startswith("127.0.0.1:"), f"{n} publishes {p} beyond loopback"
        if roles[n] == "worker":
            argv = _argv(s["command"])
            assert "--dashboard-address" in argv, f"worker {n}: its dashboard would listen on every interface"
            assert argv[argv.index("--dashboard-address") + 1].startswith("127.0.0.1:"), n
    (driver,) = [n for n, r in roles.items() if r == "driver"]
    runs = set(c.mounts(driver))
    assert runs, "the driver mounts no run directory"
    for n, r in roles.items():
        if r == "worker":
            assert runs <= set(c.mounts(n)), f"worker {n} lacks the driver's mounts {runs}"
    resources = sorted(_argv(s["command"])[_argv(s["command"]).index("--resources") + 1]
                       for n, s in c.services.items() if roles[n] == "worker")
    assert "CPU=1" in resources and "GPU=1" in resources, resources  # pipelines.clusters.RESOURCES
    assert "mlflow" in c.services and "tracking.uri=http://mlflow:5000" in _argv(c.services[driver]["command"])


def test_what_the_test_cannot_map_fails_it(tmp_path):
    """The mapping refuses instead of skipping: an unknown kind of service, a service without a command (other
    than the substituted database), an address naming no service, a backend store that does not match the
    postgres service."""
    c = Compose(tmp_path)
    failed = pytest.fail.Exception
    with pytest.raises(failed, match="none the test knows"):
        _role("cache", {"image": "redis:7", "command": "redis-server"})
    with pytest.raises(failed, match="no command"):
        _role("cache", {"image": "redis:7"})
    with pytest.raises(failed, match="no service 'sched'"):
        c.localize("env-worker", ["dask", "worker", "tcp://sched:8786"])
    assert c.localize("env-worker", ["dask", "worker", "tcp://scheduler:8786"])[2] == \
        f"tcp://127.0.0.1:{c.port('scheduler', 8786)}"
    pg = c.services[SUBSTITUTED]["environment"]
    with pytest.raises(AssertionError, match="does not match"):
        c.localize("mlflow", ["--backend-store-uri",
                              f"postgresql://{pg['POSTGRES_USER']}:wrong@postgres:5432/{pg['POSTGRES_DB']}"])
    ok = f"postgresql://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
    assert c.localize("mlflow", ["--backend-store-uri", ok]) == ["--backend-store-uri", f"sqlite:///{c.sqlite}"]
    with pytest.raises(failed, match="cannot map"):
        c._map_word("driver", "tracking.uri=mlflow:5000")  # no scheme: not an address the test can rewrite


@pytest.mark.timeout(1500)  # ~3.5 min on the 2-core machine; a loaded one (load 12) needed over 10
def test_compose_commands_run_the_smoke_experiment(tmp_path):
    from distributed import Client
    from mlflow.tracking import MlflowClient

    from pipelines.config import load_config, to_dict
    from storage.tracking import PREVIOUS_TAG, RUN_ID_TAG, SUPERSEDED_TAG, flatten_config

    t0 = time.monotonic()
    root = tmp_path / "root"
    c = Compose(root)
    logs = tmp_path / "logs"
    logs.mkdir()
    roles = {n: _role(n, s) for n, s in c.services.items()}
    cwd = Path(c.container_path("."))
    cwd.mkdir(parents=True)
    for n in c.services:
        for _, dst in c.mounts(n):
            Path(c.container_path(dst)).mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    times: dict[str, float] = {}
    driver_out = ""
    try:
        for n in c.order():
            svc, role = c.services[n], roles[n]
            if role == "substituted":
                continue
            for dep, cond in c.depends_on(n).items():  # compose's conditions, as local waits
                if cond == "service_healthy" and roles[dep] != "substituted":
                    hc = _argv(c.services[dep]["healthcheck"]["test"])
                    assert hc[0] == "CMD", f"{dep}: healthcheck {hc}: only the exec form is mapped"
                    hc_argv = c.localize(dep, hc[1:])
                    _wait(f"{dep} healthy", lambda: subprocess.run(hc_argv, env=c.env(dep), cwd=cwd,
                                                                   capture_output=True).returncode == 0, procs, logs)
                    times[f"{dep} healthy"] = time.monotonic() - t0
            argv = c.localize(n, _argv(svc["command"]))
            if role == "driver":
                workers = [n2 for n2, r in roles.items() if r == "worker"]
                sched = f"tcp://127.0.0.1:{c.port('scheduler', 8786)}"
                with Client(sched, timeout=60) as cl:  # `docker compose up -d` first: every worker registered
                    _wait("every worker registered",
                          lambda: len(cl.scheduler_info(n_workers=-1)["workers"]) >= len(workers), procs, logs)
                times["workers registered"] = time.monotonic() - t0
                driver_argv = [*argv, "conf=smoke"]
                res = subprocess.run(driver_argv, env=c.env(n), cwd=cwd, capture_output=True, text=True,
                                     timeout=DRIVER_TIMEOUT_S)
                driver_out = res.stdout + res.stderr
                times["driver done"] = time.monotonic() - t0
                assert res.returncode == 0, driver_out[-4000:]
                continue
            procs[n] = subprocess.Popen(argv, env=c.env(n), cwd=cwd, stdout=open(logs / f"{n}.log", "wb"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
            if role == "scheduler":
                port = c.port(n, 8786)
                _wait("scheduler listening", lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0,
                      procs, logs)
        print(f"\ncompose test times (s from start): {times}", file=sys.stderr)
        assert "dagrl: done: step 3 | this session: steps 1-3 (3)" in driver_out, driver_out[-3000:]

        # the workers ran the tasks: each executed some (env shards on CPU=1, the actor on GPU=1)
        with Client(f"tcp://127.0.0.1:{c.port('scheduler', 8786)}", timeout=60) as cl:
            executed = cl.run(lambda dask_worker: (dask_worker.name, dask_worker.state.executed_count))
        counts = dict(executed.values())
        assert sorted(counts) == ["env-0", "env-1", "gpu-0"] and all(v > 0 for v in counts.values()), counts
        (run_dir,) = [p for p in (cwd / "runs" / "smoke").iterdir() if p.is_dir()]
        assert (run_dir / "checkpoints" / "global_step_3").is_dir() and (run_dir / "trajectories.zarr").is_dir()
        assert not (cwd / "runs" / "mlflow.db").exists()  # tracking went to the server

        # the MLflow server: params, metrics, artifacts (in the served store, the mlartifacts volume)
        uri = f"http://127.0.0.1:{c.port('mlflow', 5000)}"
        client = MlflowClient(uri)
        cfg, _ = load_config([*driver_argv[3:]])
        exp = client.get_experiment_by_name(cfg.experiment)
        (run,) = client.search_runs([exp.experiment_id])
        assert run.data.tags[RUN_ID_TAG] == run_dir.name and run.info.status == "FINISHED"
        expected = flatten_config(to_dict(cfg))
        assert {k: run.data.params.get(k) for k in expected} == expected
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "time/step")]
        assert sorted(steps) == list(range(1, cfg.runner.max_steps + 1))
        assert cfg.runner.max_steps in [m.step for m in client.get_metric_history(run.info.run_id, "eval/success_once")]
        (artifact_dir,) = [dst for _, dst in c.mounts("mlflow")]
        served = list(Path(c.container_path(artifact_dir)).rglob("config.yaml"))
        assert len(served) == 1 and served[0].read_text() == (run_dir / "config.yaml").read_text()
        assert c.sqlite.is_file()  # the substituted backend store held it

        # --allowed-hosts as the driver's container meets it: Host mlflow:5000 answered, another host refused
        api = f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name={cfg.experiment}"
        assert _get(api, host="mlflow:5000") == 200
        assert _get(api, host="attacker.example:5000") == 403
        times["checked"] = time.monotonic() - t0

        # a resume with one more step continues the same timeline on the server, as it does in sqlite: a new MLflow
        # run of the same dagrl run id with every step once, linked to the superseded run (soft-deleted), the
        # changed keys as the artifact resumes/step_N.yaml
        first, k = run.info.run_id, cfg.runner.max_steps
        driver = next(n for n, r in roles.items() if r == "driver")
        res = subprocess.run([*driver_argv, "runner.resume=latest", f"runner.max_steps={k + 1}"], env=c.env(driver),
                             cwd=cwd, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
        (run2,) = client.search_runs([exp.experiment_id])  # active runs: the superseded one is soft-deleted
        assert run2.info.run_id != first and run2.data.tags[RUN_ID_TAG] == run_dir.name
        assert run2.data.tags[PREVIOUS_TAG] == first
        assert client.get_run(first).data.tags[SUPERSEDED_TAG] == run2.info.run_id
        assert client.get_run(first).info.lifecycle_stage == "deleted"
        assert sorted(m.step for m in client.get_metric_history(run2.info.run_id, "time/step")) == list(range(1, k + 2))
        changed = [f.path for f in client.list_artifacts(run2.info.run_id, "resumes")]
        assert changed == [f"resumes/step_{k}.yaml"]
        text = Path(client.download_artifacts(run2.info.run_id, changed[0], str(tmp_path / "dl2"))).read_text()
        assert f"runner.max_steps: {k + 1}" in text
        times["resumed"] = time.monotonic() - t0
        print(f"compose test times (s from start): {times}", file=sys.stderr)
    finally:
        for p in reversed(list(procs.values())):
            _stop(p)


# ----- docker-compose.gpu.yml: the GPU worker through dask-cuda (offline: no GPU and no Docker here) -----

COMPOSE_GPU = REPO / "docker-compose.gpu.yml"


def _merge(base, override):
    """Compose's merge of a file given after another (-f a -f b), for what these files use: mappings merged key by
    key, anything else (a command, a list) replaced; the short `build: .` is `{context: .}`."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            b = out.get(k)
            if k == "build" and isinstance(b, str):
                b = {"context": b}
            out[k] = _merge(b, v) if isinstance(b, dict) and isinstance(v, dict) else v
        return out
    return override


def _click_parses(argv: list[str]) -> None:
    """The worker's argv (after `dask cuda worker`) parses as dask-cuda's CLI when it is installed, else as
    distributed's `dask worker` (every option used here exists in both: dask_cuda/cli.py mirrors them)."""
    try:
        from dask_cuda.cli import worker as command
    except ImportError:
        from distributed.cli.dask_worker import main as command
    command.make_context("worker", list(argv), resilient_parsing=False)


def test_gpu_override_runs_dask_cuda_worker_on_every_gpu():
    """docker-compose.gpu.yml on top of docker-compose.yml: the GPU worker is `dask cuda worker` against the
    scheduler with resource GPU=1 (one worker per GPU) named so that natural order is GPU order, its dashboard on
    loopback, the driver's mounts kept, every GPU reserved through the nvidia driver; every Dask process's image
    gets the cuda extra (one dask version), an extra that pyproject declares and the Dockerfile installs from the
    build argument; the override adds no service and leaves the MLflow server's image alone."""
    import tomllib

    from pipelines.clusters import natural_order
    base = yaml.safe_load(COMPOSE.read_text())
    over = yaml.safe_load(COMPOSE_GPU.read_text())
    assert set(over["services"]) <= set(base["services"]), set(over["services"]) - set(base["services"])
    merged = _merge(base, over)["services"]
    roles = {n: _role(n, s) for n, s in base["services"].items()}
    gpu = [n for n, s in base["services"].items() if roles[n] == "worker"
           and "GPU=1" in _argv(s["command"])[_argv(s["command"]).index("--resources") + 1]]
    assert gpu == ["gpu-worker"], gpu
    argv = _argv(merged["gpu-worker"]["command"])
    assert argv[:3] == ["dask", "cuda", "worker"]
    _click_parses(argv[3:])
    opts = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert argv[3] == "tcp://scheduler:8786" and opts["--resources"] == "GPU=1"
    assert opts["--dashboard-address"].startswith("127.0.0.1:")
    names = [opts["--name"]] + [f"{opts['--name']}-{i}" for i in range(12)]  # 1 GPU; 12 GPUs (dask-cuda's naming)
    assert sorted(names[1:], key=natural_order) == names[1:]
    driver = next(n for n, r in roles.items() if r == "driver")
    assert set(Compose(Path("/x")).mounts(driver)) <= {tuple(str(v).split(":")[:2]) for v in
                                                         merged["gpu-worker"].get("volumes", [])}
    (dev,) = merged["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"] and dev["count"] == "all"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dask_services = [n for n, r in roles.items() if r in ("scheduler", "worker", "driver")]
    for n in dask_services:
        build = merged[n]["build"]
        got = build["args"]["EXTRAS"].split(",")
        assert "cuda" in got and set(got) <= set(extras) and build["context"] == ".", (n, build)
    assert merged["mlflow"]["build"] == base["services"]["mlflow"]["build"]
    assert any(d.startswith("dask-cuda") for d in extras["cuda"])
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG EXTRAS=server$", text, re.M) and '".[${EXTRAS}]"' in text
