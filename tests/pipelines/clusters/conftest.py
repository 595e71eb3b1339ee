"""A real one-node Slurm for the `cluster.kind=slurm` tests: the session fixture `slurm` and the per-test
`slurm_queue` (fails the test when it leaves a job in squeue).

Set-up (all under a fresh /tmp/dagrl-slurm-* directory, removed at the end):
- Debian's `slurm-wlm` and `munge` installed with apt-get when `slurmctld` is missing (about a minute; as root);
- a munge key (1024 random bytes, owner munge, mode 400) and `munged` in the foreground as user munge on its own
  socket;
- a slurm.conf (MACHINE.md, "Slurm and dask-jobqueue"): SlurmUser root, munge auth on that socket, linuxproc process
  tracking, no task plugin, cons_tres over cores, one node (this host at 127.0.0.1; 8 CPUs declared with
  `SlurmdParameters=config_overrides`, so the jobs of a run fit on a 2-core machine) in one partition `debug`, on
  free ports; `SLURM_CONF` points this process (and the runs and jobs it starts) at it;
- `slurmctld -D` and `slurmd -D`, waited for until the node is idle.
The daemons are stopped by their pids (SIGTERM, then SIGKILL) when the session ends, after every job is cancelled.
Skipped, with the reason, where that cannot be done: not root, no apt-get, the install or a daemon failing.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PARTITION = "debug"
NODE_CPUS = 8
NODE_MEMORY_MB = 20000


@dataclass
class LocalSlurm:
    """The running one-node Slurm: its directory, slurm.conf, the daemons' processes and logs."""

    root: Path
    conf: Path
    procs: dict = field(default_factory=dict)  # name -> subprocess.Popen

    def run(self, *args: str, check: bool = True) -> str:
        p = subprocess.run(list(args), capture_output=True, text=True, timeout=60,
                           env={**os.environ, "SLURM_CONF": str(self.conf)})
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
        return p.stdout

    def jobs(self) -> list[str]:
        """Every job in the queue, one line each: id, name, state."""
        return [ln.strip() for ln in self.run("squeue", "-h", "-o", "%i %j %T").splitlines() if ln.strip()]

    def cancel_all(self) -> None:
        ids = [ln.split()[0] for ln in self.jobs()]
        if ids:
            self.run("scancel", *ids, check=False)

    def log(self, name: str) -> str:
        f = self.root / f"{name}.log"
        return f.read_text(errors="replace")[-3000:] if f.exists() else ""


def _why_not() -> str | None:
    """None when a local Slurm can be set up here (installing it if needed), else the reason."""
    if os.geteuid() != 0:
        return "a local Slurm needs root (apt-get install slurm-wlm munge; SlurmUser=root)"
    if shutil.which("slurmctld") and shutil.which("munged"):
        return None
    if shutil.which("apt-get") is None:
        return "slurmctld/munged are not installed and there is no apt-get to install slurm-wlm and munge"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if p.returncode != 0:  # stale package lists: once more after an update
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600, env=env)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if p.returncode != 0 or not (shutil.which("slurmctld") and shutil.which("munged")):
        return f"apt-get install slurm-wlm munge failed: {(p.stderr or p.stdout).strip()[-300:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(root: Path, host: str, munge_socket: Path) -> str:
    return "\n".join([
        "ClusterName=dagrltest", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge_socket}",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
        "SlurmdParameters=config_overrides", "MpiDefault=none", "SchedulerType=sched/backfill",
        "KillWait=5", "MinJobAge=60",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} RealMemory={NODE_MEMORY_MB} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""])


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process by its pid, SIGKILL after 15 s."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _start(s: LocalSlurm) -> None:
    import pwd
    root = s.root
    munge = pwd.getpwnam("munge")
    mdir = root / "munge"
    mdir.mkdir(mode=0o700)
    os.chown(mdir, munge.pw_uid, munge.pw_gid)
    key = mdir / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chown(key, munge.pw_uid, munge.pw_gid)
    key.chmod(0o400)
    sock = mdir / "munge.socket"
    s.procs["munged"] = subprocess.Popen(
        ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={sock}", f"--pid-file={mdir}/munged.pid",
         f"--log-file={mdir}/munged.log", f"--seed-file={mdir}/munged.seed"],
        user=munge.pw_uid, group=munge.pw_gid, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not sock.exists():
        if s.procs["munged"].poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"munged did not start: {(mdir / 'munged.log').read_text(errors='replace')[-500:]}"
                               if (mdir / "munged.log").exists() else "munged did not start")
        time.sleep(0.2)
    os.chmod(mdir, 0o755)  # the socket is reached by every process of the jobs (root here)
    for d in ("state", "spool"):
        (root / d).mkdir()
    host = socket.gethostname().split(".")[0]
    s.conf.write_text(_slurm_conf(root, host, sock))
    env = {**os.environ, "SLURM_CONF": str(s.conf)}
    for name in ("slurmctld", "slurmd"):
        s.procs[name] = subprocess.Popen([name, "-D", "-f", str(s.conf)], env=env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(1.0)
    deadline = time.monotonic() + 90
    while True:
        state = s.run("sinfo", "-h", "-o", "%T", check=False).strip()
        if state == "idle":
            return
        dead = [n for n, p in s.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"the local Slurm did not come up (node {state or 'unknown'}; stopped: {dead}): "
                               f"{s.log('slurmctld')[-600:]} {s.log('slurmd')[-600:]}")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def slurm():
    """A running one-node Slurm (module docstring); `SLURM_CONF` set in this process for the session."""
    why = _why_not()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="dagrl-slurm-"))
    root.chmod(0o755)
    s = LocalSlurm(root, root / "slurm.conf")
    old = os.environ.get("SLURM_CONF")
    try:
        try:
            _start(s)
        except (RuntimeError, OSError, KeyError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"could not start a local Slurm: {exc}")
        os.environ["SLURM_CONF"] = str(s.conf)
        yield s
    finally:
        try:
            if s.conf.exists() and "slurmctld" in s.procs:
                s.cancel_all()
                deadline = time.monotonic() + 30
                while s.jobs() and time.monotonic() < deadline:
                    time.sleep(0.5)
        finally:
            for name in ("slurmd", "slurmctld", "munged"):
                if name in s.procs:
                    _stop(s.procs[name])
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm_queue(slurm):
    """`slurm`, and after the test: no job of it left in squeue (else every job is cancelled and the test errors)."""
    yield slurm
    deadline = time.monotonic() + 30  # a cancelled job leaves the queue within KillWait (5 s) + a little
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = slurm.jobs()
    if left:
        slurm.cancel_all()
        pytest.fail(f"jobs left in squeue after the test: {left}")
