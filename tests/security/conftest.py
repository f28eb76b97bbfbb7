"""Fixtures of the security tests: each test drives a real rota server the way an attacker would.

Rows about local users run the attacker as a second uid through ``setpriv`` (util-linux),
with a system user created for it; those tests skip when not run as root.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from tests.security.agentlib import agent_env, http_servers, start_agent, tenant  # noqa: F401  (fixtures)

ATTACKER = "rota-attacker"


@pytest.fixture(scope="session")
def attacker_uid() -> tuple[int, int]:
    """(uid, gid) of an unprivileged local user, created if needed (needs root and setpriv)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as a second local user")
    try:
        entry = pwd.getpwnam(ATTACKER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
                       check=True)
        entry = pwd.getpwnam(ATTACKER)
    return entry.pw_uid, entry.pw_gid


@pytest.fixture
def as_attacker(attacker_uid) -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """``as_attacker(code, env=...)``: run Python ``code`` as the second uid; returns the finished process."""
    uid, gid = attacker_uid

    def run(code: str, *, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable, "-c", code]
        base = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
        base.update(HOME="/tmp", **(env or {}))
        return subprocess.run(cmd, env=base, capture_output=True, text=True, timeout=timeout)

    yield run
