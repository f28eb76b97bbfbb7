"""Helpers for tests of rota and of plugins: a real orchestrator on loopback.

Public on purpose: adapter packages use :func:`running_orchestrator` to test against
the embedded orchestrator over real gRPC, in a thread of the test process;
:class:`ListState` is a tenant state that parks without torch, :class:`FakeDevices` fake GPUs
(names and byte counts, no memory) on which :class:`FakeDeviceState` tenants park, restore and move; :func:`eventually`
waits for a condition with a deadline, so a test that goes wrong fails instead of hanging;
:func:`new_plugin_manager` is a fresh plugin manager and :func:`cli_with_plugins` the ``rota``
command line with every plugin's commands.
"""

import contextlib
import json
import pathlib
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import rota
from rota._orchestrator.config import OrchestratorConfig
from rota._orchestrator.inproc import free_port, running_orchestrator
from rota._plugins import new_plugin_manager
from rota._tenant.client import Gpu

__all__ = ["FakeDeviceState", "FakeDevices", "ListState", "ScriptedProcess", "child_environment", "cli_with_plugins",
           "eventually", "free_port", "new_plugin_manager", "quick_config", "run_ranks", "running_orchestrator",
           "silent_listener", "tenants"]

# new_plugin_manager(load_entry_points=True): a fresh manager made as rota's process-wide one is (core's specs
# and built-ins, each plugin's own specs through rota_add_hookspecs, the installed entry points unless
# load_entry_points=False), for a test that registers plugins of its own without touching rota.plugin_manager().


def cli_with_plugins() -> Any:
    """The ``rota`` click group with core's and every installed plugin's commands added and imported (none
    left a :class:`rota.cli.lazy.LazyCommand` stand-in), for a ``CliRunner`` test that looks a command up in
    ``commands``."""
    import click

    from rota.cli.lazy import resolve
    from rota.cli.main import cli

    for name in cli.list_commands(click.Context(cli)):  # core's commands and every plugin's, as `rota --help` lists
        resolve(cli, name)
    return cli

T = TypeVar("T")


def eventually(check: Callable[[], T], what: str = "condition", timeout: float = 60.0) -> T:
    """Call ``check`` until it returns something true and return that; AssertionError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g} s")
        time.sleep(0.01)


@contextlib.contextmanager
def silent_listener() -> Iterator[str]:
    """``127.0.0.1:PORT`` of a TCP listener that accepts every connection and never answers (a hung server:
    a client's connect succeeds, its request waits); connections are held until the block ends."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    thread = threading.Thread(target=accept, name="rota-silent-listener", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        server.close()
        for conn in held:
            conn.close()


def child_environment(runtime_dir: str | pathlib.Path) -> dict[str, str]:
    """Environment for tenant subprocesses: this one's without its ROTA_* settings, with ``runtime_dir`` as
    ROTA_RUNTIME_DIR (where the embedded orchestrator's socket goes) and unbuffered output."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    env.update(ROTA_RUNTIME_DIR=str(runtime_dir), PYTHONUNBUFFERED="1")
    return env


class ListState:
    """A tenant's 'device state' as a list, parked by moving it to ``host``: an adapter without torch.

    Registers itself on ``gpu``'s plugin manager (``close()`` unregisters it) and answers
    ``rota_park``/``rota_restore``/``rota_footprint`` for that tenant only, reporting
    ``nbytes``; with ``fail`` every park raises; ``leaves`` bytes stay behind at every park, reported as
    ``untracked:state.cache`` (set it to 0 to free them; a park of a parked state measures again).
    ``calls`` lists the hooks it ran.
    """

    def __init__(self, gpu: Gpu, nbytes: int = 1000, fail: bool = False, leaves: int = 0) -> None:
        self.gpu, self.nbytes, self.fail, self.leaves = gpu, nbytes, fail, leaves
        self.device: list[int] | None = list(range(10))
        self.host: list[int] | None = None
        self.calls: list[str] = []
        gpu.pm.register(self, name=f"state-{gpu.tenant}-{id(self)}")

    @rota.hookimpl
    def rota_park(self, tenant: Gpu, plan: Any) -> rota.ParkResult | None:
        if tenant is not self.gpu:
            return None
        self.calls.append("park")
        if self.fail:
            raise RuntimeError("device said no")
        left = {"untracked:state.cache": self.leaves} if self.leaves or self.device is None else {}
        if self.device is None:  # parked already: nothing moves, what is left is read again
            return rota.ParkResult(residue=left)
        self.host, self.device = self.device, None
        return rota.ParkResult(bytes_moved=self.nbytes, residue=left)

    @rota.hookimpl
    def rota_restore(self, tenant: Gpu, plan: Any) -> rota.ParkResult | None:
        if tenant is not self.gpu:
            return None
        self.calls.append("restore")
        self.device, self.host = self.host, None
        return rota.ParkResult(bytes_moved=self.nbytes)

    @rota.hookimpl
    def rota_footprint(self, tenant: Gpu) -> dict[str, int] | None:
        return {"weights": self.nbytes} if tenant is self.gpu and self.device is not None else None

    def close(self) -> None:
        self.gpu.pm.unregister(self)


class FakeDevices:
    """A fake host's GPUs: named devices (``fake:0``...) with a capacity in bytes and no memory behind them.

    Records, for every device, which tenants' states occupy it and who computes on it,
    and every breach: a second tenant computing on a busy device, bytes over capacity.
    Tests of placement assert :attr:`breaches` stays empty.
    """

    def __init__(self, n: int, capacity: int = 0) -> None:
        self.names = tuple(f"fake:{i}" for i in range(n))
        self.capacity = capacity
        self.held: dict[str, dict[str, int]] = {d: {} for d in self.names}  # device -> tenant -> bytes
        self.computing: dict[str, str] = {}
        self.breaches: list[str] = []
        self.moves = 0
        self._lock = threading.Lock()

    def put(self, device: str, tenant: str, nbytes: int) -> None:
        with self._lock:
            self.held[device][tenant] = nbytes
            used = sum(self.held[device].values())
            if self.capacity and used > self.capacity:
                self.breaches.append(f"{device}: {used} bytes > capacity {self.capacity} ({self.held[device]})")

    def take(self, device: str, tenant: str) -> None:
        with self._lock:
            self.held[device].pop(tenant, None)

    @contextlib.contextmanager
    def compute(self, device: str, tenant: str) -> Iterator[None]:
        """A tenant's turn on ``device``: a breach if another computes there or the state is not there."""
        with self._lock:
            other = self.computing.get(device)
            if other:
                self.breaches.append(f"{device}: {tenant} granted while {other} computes there")
            if tenant not in self.held[device]:
                self.breaches.append(f"{device}: {tenant} computes there but its state is on "
                                     f"{[d for d, ts in self.held.items() if tenant in ts] or 'the host'}")
            self.computing[device] = tenant
        try:
            yield
        finally:
            with self._lock:
                if self.computing.get(device) == tenant:
                    del self.computing[device]


class FakeDeviceState:
    """A tenant's state of ``nbytes`` on :class:`FakeDevices`: built on the device of its first turn, parked to
    the host, restored to the granted device, moved device to device when its turn is elsewhere."""

    def __init__(self, gpu: Gpu, devices: FakeDevices, nbytes: int) -> None:
        self.gpu, self.devices, self.nbytes = gpu, devices, nbytes
        self.where = ""  # device holding the state; "" = host (parked) or not built yet
        self.built = False
        self.calls: list[str] = []
        gpu.pm.register(self, name=f"fake-state-{gpu.tenant}-{id(self)}")

    def build(self, device: str) -> None:
        if not self.built:
            self.built, self.where = True, device
            self.devices.put(device, self.gpu.tenant, self.nbytes)

    @rota.hookimpl
    def rota_park(self, tenant: Gpu, plan: Any) -> rota.ParkResult | None:
        if tenant is not self.gpu or not self.where:
            return None
        self.calls.append("park")
        self.devices.take(self.where, tenant.tenant)
        self.where = ""
        return rota.ParkResult(bytes_moved=self.nbytes)

    @rota.hookimpl
    def rota_restore(self, tenant: Gpu, plan: Any) -> rota.ParkResult | None:
        if tenant is not self.gpu or not self.built:
            return None
        target = plan.device or self.where
        if self.where and self.where != target:
            self.calls.append("move")
            self.devices.moves += 1
            self.devices.put(target, tenant.tenant, self.nbytes)  # both ends hold it while the copy runs
            self.devices.take(self.where, tenant.tenant)
        elif not self.where:
            self.calls.append("restore")
            self.devices.put(target, tenant.tenant, self.nbytes)
        self.where = target
        return rota.ParkResult(bytes_moved=self.nbytes)

    @rota.hookimpl
    def rota_footprint(self, tenant: Gpu) -> dict[str, int] | None:
        return {"weights": self.nbytes} if tenant is self.gpu else None  # also while parked, as rota_torch's

    def close(self) -> None:
        if self.where:
            self.devices.take(self.where, self.gpu.tenant)
        self.gpu.pm.unregister(self)


@contextlib.contextmanager
def tenants(endpoint: str, *, before_close: Callable[[list[Gpu]], None] | None = None
            ) -> Iterator[Callable[..., Gpu]]:
    """Yield ``connect(tenant, group="g") -> Gpu`` for ``endpoint``; every Gpu it made is
    closed when the block ends (after ``before_close(gpus)``, e.g. to untrack models)."""
    made: list[Gpu] = []

    def connect(tenant: str, group: str = "g") -> Gpu:
        gpu = rota.connect(group=group, tenant=tenant, endpoint=endpoint)
        made.append(gpu)
        return gpu

    try:
        yield connect
    finally:
        if before_close is not None:
            before_close(made)
        for gpu in made:
            gpu.close()


def quick_config() -> OrchestratorConfig:
    """Short TTL and park timeout, so a test that goes wrong fails in seconds."""
    return OrchestratorConfig(ttl_s=5.0, park_timeout_s=30.0)


def run_ranks(worker: str, args: Callable[[int], list[str]], *, world: int, logdir: pathlib.Path,
              timeout: float, env: dict[str, str] | None = None) -> None:
    """Run ``python worker *args(rank)`` for each rank at once, with one thread each and
    no inherited ROTA_* settings; fail with the rank's log tail if any rank fails or hangs."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    logs = [logdir / f"rank{r}.log" for r in range(world)]
    files = [open(path, "w") for path in logs]
    procs = [subprocess.Popen([sys.executable, worker, *args(r)], env=base, stdout=f, stderr=subprocess.STDOUT)
             for r, f in enumerate(files)]
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    for path, p in zip(logs, procs, strict=True):
        if p.returncode != 0:
            raise AssertionError(f"{path.name} exited with {p.returncode}:\n{path.read_text()[-3000:]}")


class ScriptedProcess:
    """A Python script run as a child that takes one command per stdin line and answers JSON lines.

    Tests drive real tenant processes this way; every read has a timeout, so a hung
    child fails its test instead of blocking the suite. The first line the child
    prints is kept as :attr:`ready`.
    """

    def __init__(self, script: str, args: list[str], env: dict[str, str], *, timeout: float = 30) -> None:
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, script, *args], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready = self.read(60)

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def read(self, timeout: float | None = None) -> dict:
        """The child's next answer; EOFError naming its exit code if it exited."""
        msg = self.lines.get(timeout=timeout or self.timeout)
        if msg is None:
            raise EOFError(f"{self.proc.args[1]} exited with {self.proc.wait(5)}")
        return msg

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def ask(self, cmd: str, timeout: float | None = None) -> dict:
        self.send(cmd)
        return self.read(timeout)

    def stop(self) -> None:
        """Ask it to exit; kill it if it does not within 10 s."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait(10)
