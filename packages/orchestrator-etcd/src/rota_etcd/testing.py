"""Real etcd members and orchestrator replicas on loopback, for tests and benchmarks.

Public on purpose: other packages (schedulers, benchmarks) start the same clusters.
Needs the ``etcd`` binary (Debian ``etcd-server``; ``scripts/services.sh install``).
Every process started here is stopped by its own pid.

    with EtcdCluster(tmp_path, size=3) as etcd:
        etcd.url                  # "http://127.0.0.1:P1,http://127.0.0.1:P2,..."
        etcd.kill(0); etcd.restart(0)

    with OrchestratorProcess(etcd.url, tmp_path / "o1.log") as orch:
        orch.endpoint             # "127.0.0.1:P"
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import grpc

from rota.testing import free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def etcd_available() -> bool:
    return os.path.exists(ETCD) and os.access(ETCD, os.X_OK)


class EtcdMember:
    """One etcd member process with its own data directory and log."""

    def __init__(self, name: str, folder: pathlib.Path) -> None:
        self.name = name
        self.client_port, self.peer_port = free_port(), free_port()
        self.data_dir = folder / f"{name}.data"
        self.log_path = folder / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, initial_cluster: str, state: str = "new") -> None:
        args = [ETCD, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
                "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", initial_cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", f"rota-test-{os.getpid()}", "--log-level", "warn",
                "--logger", "zap"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.running:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def healthy(self, timeout: float = 0.5) -> bool:
        """True if this member answers a linearizable read (so it has a leader)."""
        from aetcd import rpc

        with grpc.insecure_channel(f"127.0.0.1:{self.client_port}") as ch:
            try:
                rpc.KVStub(ch).Range(rpc.RangeRequest(key=b"/health-probe"), timeout=timeout)
                return True
            except grpc.RpcError:
                return False


class EtcdCluster:
    """``size`` etcd members on loopback ports, started together, stopped by pid."""

    def __init__(self, folder: os.PathLike | str, size: int = 1) -> None:
        self.folder = pathlib.Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.members = [EtcdMember(f"m{i}", self.folder) for i in range(size)]

    @property
    def url(self) -> str:
        return ",".join(m.client_url for m in self.members)

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        for m in self.members:
            m.start(self.initial_cluster)
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 30.0, members: Sequence[int] | None = None) -> None:
        deadline = time.monotonic() + timeout
        for i in range(len(self.members)) if members is None else members:
            m = self.members[i]
            while not m.healthy():
                if not m.running:
                    raise RuntimeError(f"etcd member {m.name} exited; its log {m.log_path} ends with:\n"
                                       f"{m.log_path.read_text(errors='replace')[-2000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd member {m.name} not healthy within {timeout:g} s; see {m.log_path}")
                time.sleep(0.05)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data stays; :meth:`restart` brings it back)."""
        self.members[i].kill()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        m = self.members[i]
        m.kill()
        m.start(self.initial_cluster, state="existing")
        self.wait_healthy(timeout, [i])

    def stop(self) -> None:
        for m in self.members:
            m.kill()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class OrchestratorProcess:
    """``rota orchestrator serve --etcd URL`` as a child process (one replica)."""

    def __init__(self, etcd_url: str, log_path: os.PathLike | str, *, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.etcd_url, self.log_path = etcd_url, pathlib.Path(log_path)
        self.port = port or free_port()
        self.args, self.env = list(args), env
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> OrchestratorProcess:
        """Start the replica and wait until it serves; a replica already running is left as it is (starting a
        second process would orphan the first, which kept serving after the test)."""
        if self.running:
            return self
        env = dict(self.env if self.env is not None else os.environ)
        env.setdefault("ROTA_ETCD_LEADER_TTL", "2")
        env["PYTHONUNBUFFERED"] = "1"
        level = os.environ.get("ROTA_TEST_LOG_LEVEL", "info")
        security = [] if "--auth-key" in self.args else ["--insecure"]  # the tests' loopback replicas check
        cmd = [sys.executable, "-m", "rota", "--log-level", level, "orchestrator", "serve", "--etcd", self.etcd_url,
               "--listen", self.endpoint, *security, *self.args]  # nobody unless given --auth-key in args
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.serving():
            if self.proc.poll() is not None:
                raise RuntimeError(f"orchestrator exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"orchestrator not serving on {self.endpoint} within {timeout:g} s")
            time.sleep(0.05)
        return self

    def serving(self) -> bool:
        with grpc.insecure_channel(self.endpoint) as ch:
            try:
                grpc.channel_ready_future(ch).result(timeout=0.2)
                return True
            except grpc.FutureTimeoutError:
                return False

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.running:
            assert self.proc is not None
            os.kill(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        self.kill(signal.SIGKILL)

    def __enter__(self) -> OrchestratorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def leader_of(etcd_url: str, prefix: str = "/rota") -> dict | None:
    """The leader record in etcd (synchronous, for tests), or None."""
    import json

    from aetcd import rpc

    from rota_etcd._etcd import parse_endpoints

    key = f"/{prefix.strip('/')}/leader".replace("//", "/").encode()
    for ep in parse_endpoints(etcd_url):
        with grpc.insecure_channel(ep) as ch:
            try:
                reply = rpc.KVStub(ch).Range(rpc.RangeRequest(key=key), timeout=2)
            except grpc.RpcError:
                continue
            return json.loads(reply.kvs[0].value) if reply.kvs else None
    return None


def shard_leaders(etcd_url: str, prefix: str = "/rota") -> dict[int, str]:
    """shard -> its leader's address, as etcd has it with ROTA_ETCD_SHARDS > 1 (synchronous, for tests)."""
    import json

    from aetcd import rpc

    from rota_etcd._etcd import parse_endpoints, prefix_end

    key = f"/{prefix.strip('/')}/shards/".replace("//", "/").encode()
    for ep in parse_endpoints(etcd_url):
        with grpc.insecure_channel(ep) as ch:
            try:
                reply = rpc.KVStub(ch).Range(rpc.RangeRequest(key=key, range_end=prefix_end(key)), timeout=2)
            except grpc.RpcError:
                continue
            return {int(kv.key.decode().split("/")[-2]): json.loads(kv.value)["address"] for kv in reply.kvs}
    return {}


@contextlib.contextmanager
def replicas(etcd_url: str, folder: os.PathLike | str, n: int = 2, **kw: object) -> Iterator[list[OrchestratorProcess]]:
    """``n`` orchestrator replicas against one etcd, stopped on exit."""
    folder = pathlib.Path(folder)
    procs = [OrchestratorProcess(etcd_url, folder / f"orchestrator-{i}.log", **kw) for i in range(n)]  # type: ignore[arg-type]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()
