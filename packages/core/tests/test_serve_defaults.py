"""`rota orchestrator serve` with no flags starts something useful: an orchestrator on this user's Unix socket
(a 0700 folder, the socket 0600), where tenants and `rota status` on this host find it with nothing configured.

Real parts: `rota orchestrator serve`, `rota status` and a tenant in their own processes, over the real socket.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from rota.testing import child_environment

TENANT = "import rota; g = rota.connect(group='g', tenant='t'); g.acquire(); g.release(); g.close()"


def test_plain_serve_listens_on_the_private_socket_that_clients_find(tmp_path):
    runtime = tmp_path / "rt"  # does not exist yet: serve makes it
    env = child_environment(runtime)
    server = subprocess.Popen([sys.executable, "-m", "rota", "orchestrator", "serve"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        started = server.stderr.readline()
        sock = runtime / "orchestrator.sock"
        assert started.startswith(f"rota orchestrator serving on unix:{sock} "), started
        assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(sock).st_mode)

        tenant = subprocess.run([sys.executable, "-c", TENANT], env=env, capture_output=True, text=True, timeout=60)
        assert tenant.returncode == 0, tenant.stderr
        shown = subprocess.run([sys.executable, "-m", "rota", "status", "--json"], env=env, capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert '"job_id": "t"' in shown.stdout and f"embedded@unix:{sock}" in shown.stdout  # this server's

        again = subprocess.run([sys.executable, "-m", "rota", "orchestrator", "serve"], env=env, capture_output=True,
                               text=True, timeout=60)
        assert again.returncode == 2 and f"an orchestrator already serves at unix:{sock}" in again.stderr
        assert server.poll() is None  # the first one is untouched
    finally:
        server.terminate()
        server.wait(timeout=10)
