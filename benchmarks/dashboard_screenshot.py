"""Screenshot of the Dask dashboard's task stream while a short default-config training job runs.

Starts `python -m pipelines.run` (the default experiment, a few steps, dashboard on a fixed port) as a
subprocess, waits until it has run `--delay` seconds past its first training step, captures the dashboard page
with headless Chromium (Debian's `chromium` package: `apt-get install chromium`; driven over its DevTools
protocol, see `screenshot`) and stops the job:

    python benchmarks/dashboard_screenshot.py [--page individual-task-stream] [--out docs/dashboard_task_stream.png]
        [--delay 20] [--wait 8] [--window-size 1600,900] [OVERRIDE ...]

OVERRIDEs are passed to pipelines.run (e.g. `rollout.inference=disaggregated`). Prints the PNG path and size.
Task names to look for in the picture: env_step_s0/s1 (env stepping with the replica's inference inside),
weights_handle, trajectory_s*, store_s*, advantages_s*, actor_update, update_handle, step_metrics.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wait_http(url: str, timeout_s: float) -> None:
    """Poll `url` until it answers 200 (raises TimeoutError)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def screenshot(url: str, out: Path, window_size: str, wait_s: float) -> None:
    """Headless Chromium: load `url`, wait `wait_s` seconds of real time, write a PNG of the window to `out`.

    The dashboard's plots arrive over a Bokeh websocket after the page's load event, and `chromium --screenshot`
    captures at load (its `--virtual-time-budget` does not wait for websocket traffic: the PNG came out blank), so
    the capture goes through Chromium's DevTools protocol instead (`Page.navigate`, then
    `Page.captureScreenshot` after the wait), spoken with tornado's websocket client (a Dask dependency).
    """
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("error: chromium not found; install Debian's package: apt-get install chromium")
    import base64
    import json

    from tornado.ioloop import IOLoop
    from tornado.websocket import websocket_connect

    port = _free_port()
    with tempfile.TemporaryDirectory() as profile:
        browser = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}",
             f"--window-size={window_size}", f"--remote-debugging-port={port}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_http(f"http://127.0.0.1:{port}/json/version", 30)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                target = next(t for t in json.load(r) if t["type"] == "page")

            async def capture() -> bytes:
                ws = await websocket_connect(target["webSocketDebuggerUrl"], max_message_size=256 * 2**20)
                ids = iter(range(1, 10**6))

                async def call(method: str, **params):
                    i = next(ids)
                    await ws.write_message(json.dumps({"id": i, "method": method, "params": params}))
                    while True:
                        msg = json.loads(await ws.read_message())
                        if msg.get("id") == i:
                            if "error" in msg:
                                raise RuntimeError(f"{method}: {msg['error']}")
                            return msg["result"]
                await call("Page.enable")
                await call("Page.navigate", url=url)
                await asyncio.sleep(wait_s)
                shot = await call("Page.captureScreenshot", format="png")
                ws.close()
                return base64.b64decode(shot["data"])
            import asyncio
            out.write_bytes(IOLoop.current().run_sync(capture, timeout=wait_s + 60))
        finally:
            browser.terminate()
            browser.wait(timeout=30)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "dashboard_task_stream.png"))
    ap.add_argument("--page", default="individual-task-stream", help="dashboard page: individual-task-stream, status")
    ap.add_argument("--port", type=int, default=8797)
    ap.add_argument("--delay", type=float, default=20.0, help="seconds after the first step before the capture")
    ap.add_argument("--window-size", default="1600,900")
    ap.add_argument("--wait", type=float, default=8.0, help="seconds the page renders before the capture")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    run_root = tempfile.mkdtemp(prefix="dagrl-dashboard-")
    cmd = [sys.executable, "-m", "pipelines.run", f"run_root={run_root}", "runner.max_steps=12",
           "runner.val_check_interval=100", "runner.save_interval=100", "runner.progress=false",
           f"cluster.dashboard_address=127.0.0.1:{args.port}", *args.overrides]
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in job.stdout:  # "dagrl: run ... | run dir ..." comes once the cluster is up and the actor built
            print(line, end="")
            if line.startswith("dagrl: run "):
                break
        else:
            raise SystemExit(f"error: the job ended before starting (exit {job.wait()})")
        url = f"http://127.0.0.1:{args.port}/{args.page}"
        wait_http(url, 60)
        time.sleep(args.delay)
        screenshot(url, out, args.window_size, args.wait)
        print(f"screenshot: {out} ({out.stat().st_size} bytes) of {url}")
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)  # pipelines.run closes its cluster on SIGTERM
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
        shutil.rmtree(run_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from pipelines.cli import entry
    sys.exit(entry(main))  # Ctrl-C: one line `interrupted`, exit 130
