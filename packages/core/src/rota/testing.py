"""Helpers for tests of rota and of plugins: a real orchestrator on loopback.

Public on purpose: adapter packages use :func:`running_orchestrator` to test against
the embedded orchestrator over real gRPC, in a thread of the test process.
"""

import contextlib
import json
import pathlib
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import rota
from rota._client import Gpu
from rota._engine import OrchestratorConfig
from rota._inproc import free_port, running_orchestrator

__all__ = ["ScriptedProcess", "free_port", "quick_config", "run_ranks", "running_orchestrator", "tenants"]


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
