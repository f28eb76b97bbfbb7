"""The embedded orchestrator: started on demand, one per user per host, on a Unix socket.

``rota.connect()`` with no ``ROTA_ORCHESTRATOR`` calls :func:`ensure_local_orchestrator`,
which finds a running local orchestrator or starts one in the background (a file lock
makes concurrent first clients start exactly one). It exits after 30 s with no tenants.

Who may call it: only its owner (and root). It needs no token because its socket lives
in a directory that this uid owns with mode 0700: nobody else can even reach the socket.
That directory is checked, never trusted: a directory another uid made (or made
world-writable, or a symbolic link) in the way is refused with the reason, the lock file
is opened without following links, and a socket in it is never replaced while serving.

Environment:
    ROTA_RUNTIME_DIR  folder for the socket, lock and log (default $XDG_RUNTIME_DIR/rota,
                      else /tmp/rota-<uid>)
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import stat
import subprocess
import sys
import time

import grpc

from rota.errors import ConfigError, Unavailable

IDLE_EXIT_S = 30


def runtime_dir() -> pathlib.Path:
    """This uid's private folder for the embedded orchestrator: created 0700, or checked to be exactly that."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    path = pathlib.Path(os.environ.get("ROTA_RUNTIME_DIR") or (f"{xdg}/rota" if xdg else f"/tmp/rota-{os.getuid()}"))
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        pass  # private_folder says what is wrong with the folder itself
    private_folder(str(path), "the embedded orchestrator's folder", "another user may have made it first: set "
                   "ROTA_RUNTIME_DIR to a folder of yours (e.g. ~/.rota-run; or have it removed by root or its "
                   "owner), or XDG_RUNTIME_DIR to your login session's")
    return path


def private_socket_folder(socket_path: str) -> None:
    """Check (or create, mode 0700) the folder a Unix-socket server is about to listen in: this uid's own and
    closed to everyone else, so only its owner (and root) can reach the socket, which the server makes 0600."""
    private_folder(os.path.dirname(os.path.abspath(socket_path)), "the socket's folder",
                   "listen on unix:PATH in a folder of yours with mode 700 (mkdir -m 700 DIR, or chmod 700 it)")


def private_folder(path: str, what: str, fix: str) -> None:
    """Create ``path`` 0700, or check that it is a real folder of this uid that no one else may enter."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create {what} {path!r}: {exc.strerror}; {fix}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a symbolic link or not a folder"
        raise ConfigError(f"{what} {path!r} is {kind} of uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}; it must "
                          f"be a real folder of uid {os.geteuid()} with mode 700, where no other user can reach or "
                          f"replace a socket: {fix}")


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
    fd = os.open(folder / "orchestrator.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as lock:
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
