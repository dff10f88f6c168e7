"""No Ray process outlives `verispec serve --ray` (issue 45, class 10): after the server stops
(SIGTERM), is interrupted (SIGINT) or is killed outright (SIGKILL), no process of the local Ray
instance it started is left; the raylet's DashboardAgent and RuntimeEnvAgent used to stay as
orphans. Marked ``ray`` (a local Ray instance each: slow)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from serving import wait_for_line

SERVER_ARGS = ["--model", "stories260k", "--max-batch", "4", "--max-model-len", "512"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(url: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, proc.stdout.read()
    with contextlib.suppress(httpx.TransportError):
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    return False


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, what
        time.sleep(0.2)


def _ray_left(t0: float, recorded: list) -> list[str]:
    """Processes still alive among ``recorded`` (psutil processes) and any process naming Ray
    started since ``t0`` outside this test process's own tree (its Ray instance's workers)."""
    import psutil

    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    left = [p for p in recorded if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        with contextlib.suppress(psutil.Error):
            if (p.info["create_time"] >= t0 and p.pid not in ours and p not in left
                    and "ray" in " ".join(p.info["cmdline"] or []).lower() and p.status() != psutil.STATUS_ZOMBIE):
                left.append(p)
    out = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            out.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
    return out


@pytest.mark.ray
@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_no_ray_process_outlives_the_server(stop: str) -> None:
    """After `serve --ray` ends (stopped, Ctrl-C, or killed outright) no process of its local Ray
    instance is left: the raylet's DashboardAgent and RuntimeEnvAgent used to stay as orphans."""
    import signal

    import psutil

    t0 = time.time() - 1
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", *SERVER_ARGS, "--ray", "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    recorded: list = []
    try:
        _wait(lambda: _up(f"http://127.0.0.1:{port}", proc), 240, "the Ray deployment did not come up")
        wait_for_line(proc, "verispec: serving", 120)
        recorded = psutil.Process(proc.pid).children(recursive=True)
        assert any("DashboardAgent" in " ".join(p.cmdline()) for p in recorded), recorded
        proc.send_signal(getattr(signal, stop))
        proc.communicate(timeout=120)
        deadline = time.time() + 30
        while _ray_left(t0, recorded) and time.time() < deadline:
            time.sleep(0.5)
        assert _ray_left(t0, recorded) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for p in recorded:  # never leave them to the next test
            with contextlib.suppress(psutil.Error):
                p.kill()
