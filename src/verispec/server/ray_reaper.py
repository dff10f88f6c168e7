"""The end of a local Ray instance that ``verispec serve --ray`` started: no Ray process outlives
the server.

``ray.shutdown()`` stops the processes Ray started (GCS, raylet, dashboard, log monitor), and the
raylet's children (``DashboardAgent``, ``RuntimeEnvAgent``, the workers) follow. But where the
server dies without running its shutdown (``kill -9``, an out-of-memory kill), the raylet's
agents were left running as orphans (measured with Ray 2.60: both agents still alive 10 s after
the server was killed, the workers gone). So once the local instance is up, ``start`` records its
processes (the server's descendants whose command line names Ray) in a small reaper process that
waits for the server to end (its stdin closes: on exit, crash or kill alike); then it stops the
recorded processes still alive (SIGTERM, and SIGKILL after ``GRACE_S``), each checked by its
start time so a reused pid is never hit. ``stop`` (the server's own shutdown, after
``ray.shutdown()``) closes the pipe and waits for the reaper.

The reaper ignores SIGINT and SIGTERM: a Ctrl-C in the terminal (sent to the whole process group)
must not end it before the server has shut down.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

GRACE_S = 5.0  # from SIGTERM to SIGKILL


def ray_processes(root: int | None = None) -> list[tuple[int, float]]:
    """(pid, start time) of ``root``'s (default: this process's) descendants whose command line
    names Ray (``ray::DashboardAgent``, ``.../ray/core/src/ray/raylet/raylet``, ...)."""
    import psutil

    out = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if "ray" in " ".join(p.cmdline()).lower():
                out.append((p.pid, p.create_time()))
        except psutil.Error:  # gone meanwhile
            continue
    return out


def start() -> subprocess.Popen | None:
    """A reaper of the local Ray instance's processes (None where psutil is missing)."""
    try:
        procs = ray_processes()
    except ImportError:
        return None
    return subprocess.Popen([sys.executable, "-m", __name__, json.dumps(procs)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(reaper: subprocess.Popen | None, timeout: float = 2 * GRACE_S + 5) -> None:
    """The server's shutdown is done: the reaper stops what is left and ends."""
    if reaper is None:
        return
    if reaper.stdin is not None:
        reaper.stdin.close()
    try:
        reaper.wait(timeout)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def reap(procs: list[Any], grace: float = GRACE_S) -> None:
    """SIGTERM the recorded (pid, start time) processes still alive, SIGKILL those left after ``grace``."""
    import psutil

    alive = []
    for pid, started in procs:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - started) < 1e-3:
                p.terminate()
                alive.append(p)
        except psutil.Error:
            continue
    _, left = psutil.wait_procs(alive, timeout=grace)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=grace)


def _main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    procs = json.loads(sys.argv[1])
    sys.stdin.buffer.read()  # until the server closes the pipe, or dies
    reap(procs)


if __name__ == "__main__":
    _main()
