"""Fixtures of the security tests: each test drives a real rota server the way an attacker would.

Rows about local users run the attacker as a second uid through ``setpriv`` (util-linux),
with a system user created for it; those tests skip when not run as root. The node agent's rows get
a real ``rota agent serve`` process (``start_agent``), tenants registered with it (``tenant``) and HTTP
servers that record what they are sent (``http_servers``), built on tests/security/agentlib.py.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator

import pytest

from rota import auth
from rota.testing import ScriptedProcess, free_port
from tests.security.agentlib import ROTA, TENANT, Agent, Recorder

ATTACKER = "rota-attacker"


@pytest.fixture(scope="module", autouse=True)
def tinker_clients_closed(request: pytest.FixtureRequest) -> Iterator[list[pytest.Item | pytest.Module]]:
    """Every Tinker SDK client a Tinker test module makes is closed when what made it ends: a test's at the test's
    end, a module fixture's (a victim's model, a tenant's trainer) at the module's end, each before the fixtures set
    up ahead of it (its server) are torn down, so closing reaches a live server. Why: an unclosed client's session
    heartbeats for minutes in the pytest process, and its "heartbeat failed" warnings once landed inside a later
    test's log capture (test_compat, at e749a8a; alice's and mallory's module-fixture sessions again at 5e20e33)."""
    where: list[pytest.Item | pytest.Module] = [request.node]  # whose end closes a client made now
    if "tinker" not in request.module.__name__:
        yield where
        return
    import tinker

    init = tinker.ServiceClient.__init__

    def recording_init(self: tinker.ServiceClient, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        where[-1].addfinalizer(lambda: _close_tinker_client(self))  # pytest runs a node's finalizers last-in first

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tinker.ServiceClient, "__init__", recording_init)
        yield where


@pytest.fixture(autouse=True)
def tinker_clients_of_the_test(request: pytest.FixtureRequest,
                               tinker_clients_closed: list[pytest.Item | pytest.Module]) -> Iterator[None]:
    """While a test runs, the clients it (or a fixture of its) makes are closed at its end (see above)."""
    tinker_clients_closed.append(request.node)
    yield
    tinker_clients_closed.pop()


def _close_tinker_client(client: object) -> None:
    with contextlib.suppress(Exception):  # a refused or failed test's client: closing is best effort
        client.close("success").result(timeout=5)  # type: ignore[attr-defined]


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


@pytest.fixture
def agent_env(child_env) -> dict[str, str]:
    return dict(child_env, ROTA_LOAD_PLUGINS="rota-agent")


@pytest.fixture
def start_agent(agent_env, tmp_path) -> Iterator[Callable[..., Agent]]:
    """start_agent(*flags, keyed=True): a real agent process; stopped (and its socket dir removed) afterwards."""
    started: list[Agent] = []

    def start(*flags: str, keyed: bool = True) -> Agent:
        socket_dir = tempfile.mkdtemp(prefix="rota-sec-")
        os.chmod(socket_dir, 0o755)  # other uids may reach the sockets (the door tells who they are)
        args = [ROTA, "agent", "serve", "--listen", f"127.0.0.1:{free_port()}", "--socket-dir", socket_dir, *flags]
        key = None
        if not keyed:
            args.append("--insecure")  # TCP without tokens (without it a keyless agent serves only its sockets)
        if keyed:
            path = tmp_path / f"key{len(started)}"
            auth.generate_key(str(path))
            key = auth.load_key(str(path))
            args += ["--auth-key", str(path)]
        proc = subprocess.Popen(args, env=agent_env, stderr=subprocess.PIPE, text=True)
        agent = Agent(key, args[4], socket_dir, proc)
        started.append(agent)
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()  # type: ignore[union-attr]
            assert line or proc.poll() is None, f"rota agent serve exited with {proc.wait()}"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # type: ignore[union-attr]  # keep it drained
        return agent

    yield start
    for agent in started:
        agent.proc.terminate()
        agent.proc.wait(20)
        shutil.rmtree(agent.dir, ignore_errors=True)


@pytest.fixture
def tenant(agent_env) -> Iterator[Callable[..., ScriptedProcess]]:
    """tenant(agent, job, *args, token=...): a tenant_proc.py process registered with the agent's Unix socket."""
    started: list[ScriptedProcess] = []

    def start(agent: Agent, job: str, *args: str, token: str | None = None, group: str = "g") -> ScriptedProcess:
        child = dict(agent_env, ROTA_LOAD_PLUGINS="")
        if agent.key:
            child["ROTA_TOKEN"] = token if token is not None else agent.token(job, group)
        t = ScriptedProcess(TENANT, ["--mode", "v1", "--orch", "127.0.0.1:1", "--agent", agent.unix, "--job", job,
                                     "--group", group, *args], child, timeout=30)
        started.append(t)
        return t

    yield start
    for t in started:
        t.stop()


@pytest.fixture
def http_servers() -> Iterator[Callable[..., Recorder]]:
    made: list[Recorder] = []

    def make(answer: Callable[[str], tuple[int, dict[str, str], bytes]]) -> Recorder:
        made.append(Recorder(answer))
        return made[-1]

    yield make
    for s in made:
        s.shutdown()
        s.server_close()


def pytest_sessionfinish() -> None:
    """Quiet the tinker SDK's heartbeat warnings once the run is over. Test services stop with no farewell
    (``farewell_s`` 0: a farewell waits up to a heartbeat period per service), so the SDK clients of stopped
    services keep heart-beating at closed ports and warn after 2 minutes, after pytest's closing line."""
    import logging

    logging.getLogger("tinker.lib.internal_client_holder").setLevel(logging.ERROR)
