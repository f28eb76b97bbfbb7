"""The embedded orchestrator: started on demand, one per user per host, on a Unix socket.

``rota.connect()`` with no ``ROTA_ORCHESTRATOR`` calls :func:`ensure_local_orchestrator`,
which finds a running local orchestrator or starts one in the background (a file lock
makes concurrent first clients start exactly one). It exits after 30 s with no tenants.

Environment:
    ROTA_RUNTIME_DIR  folder for the socket, lock and log (default /tmp/rota-<uid>)
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import subprocess
import sys
import time

import grpc

from rota.errors import Unavailable

IDLE_EXIT_S = 30


def runtime_dir() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("ROTA_RUNTIME_DIR") or f"/tmp/rota-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def local_endpoint() -> str:
    return f"unix:{runtime_dir() / 'orchestrator.sock'}"


def is_serving(endpoint: str, timeout: float = 0.3) -> bool:
    with grpc.insecure_channel(endpoint) as ch:
        try:
            grpc.channel_ready_future(ch).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False


def ensure_local_orchestrator(timeout: float = 20.0) -> str:
    """Return the embedded orchestrator's endpoint, starting it if nobody serves there."""
    endpoint = local_endpoint()
    if is_serving(endpoint):
        return endpoint
    folder = runtime_dir()
    with open(folder / "orchestrator.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_serving(endpoint):
            return endpoint
        (folder / "orchestrator.sock").unlink(missing_ok=True)
        log_path = folder / "orchestrator.log"
        with open(log_path, "ab") as log:
            subprocess.Popen(
                [sys.executable, "-m", "rota", "orchestrator", "serve", "--listen", endpoint,
                 "--idle-exit", str(IDLE_EXIT_S)],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if is_serving(endpoint, 0.5):
                return endpoint
        tail = log_path.read_text(errors="replace")[-2000:]
        raise Unavailable(f"the embedded orchestrator did not start within {timeout:g} s at {endpoint}; "
                          f"its log ({log_path}) ends with:\n{tail}")
