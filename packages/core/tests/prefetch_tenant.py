"""A tenant process for the prefetch tests, driven line by line over stdin/stdout (JSON).

Its "device state" is a bytes payload of ``--size`` bytes, reported as its footprint
while on the device; its park hook moves it to a host copy and its restore hook moves
it back. With ``--agent`` it is registered with a node agent, which parks and restores it on the
orchestrator's request (the path a prefetch takes for agent-held jobs); without, the
orchestrator asks its client over the rota.v1 session (park and restore commands).

    python prefetch_tenant.py --orch HOST:PORT [--agent HOST:PORT] --job J --group G --size N
                              [--block-on-restore FILE] [--tensor] [--fail-restores K]
commands: acquire | acquire-quiet (a quiet turn) | release | check | exit. With --block-on-restore, a restore creates
FILE.started and then waits until FILE exists (so a test can act while it runs). With
--tensor the payload is a CPU tensor tracked by rota_torch's TensorParker (what the
torch adapters use). With --fail-restores, the first K restores raise before moving
anything (the state stays parked, as an adapter's rolled-back restore leaves it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import rota
from rota_agent import register


def wait_at_gate(gate: str) -> None:
    """With --block-on-restore: say the restore started, then wait until the test opens the gate."""
    if gate:
        open(gate + ".started", "w").close()
        while not os.path.exists(gate):
            time.sleep(0.01)


class Device:
    """The payload and where it is; counts parks and restores."""

    def __init__(self, size: int, block: str) -> None:
        self.payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
        self.device: bytes | None = self.payload
        self.host: bytes | None = None
        self.parks = self.restores = 0
        self.block = block

    def park(self) -> None:
        if self.device is not None:
            self.host, self.device = bytes(self.device), None
            self.parks += 1

    def restore(self) -> None:
        wait_at_gate(self.block)
        if self.host is not None:
            self.device, self.host = self.host, None
            self.restores += 1


class TensorDevice:
    """The payload as a tracked CPU tensor, parked and restored by a TensorParker."""

    def __init__(self, size: int, block: str) -> None:
        import torch

        from rota_torch import HostPool, TensorParker

        self.tensor = (torch.arange(size) % 251).to(torch.uint8)
        self.expected = self.tensor.clone()
        self.parker = TensorParker("cpu", pool=HostPool(pin=False), name="prefetch-tenant", verify="full")
        self.parker.add("weights", {"payload": self.tensor})
        self.parks = self.restores = 0
        self.block = block

    @property
    def device(self) -> object | None:
        return None if self.parker.parked else self.tensor

    @property
    def intact(self) -> bool:
        import torch

        return bool(torch.equal(self.parker.host_tensor(self.tensor), self.expected))

    def park(self) -> None:
        if not self.parker.parked:
            self.parker.park()
            self.parks += 1

    def restore(self) -> None:
        wait_at_gate(self.block)
        if self.parker.parked:
            self.parker.restore()
            self.restores += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--orch", "--job", "--group"):
        ap.add_argument(a, required=True)
    ap.add_argument("--agent", default="")
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--block-on-restore", default="")
    ap.add_argument("--tensor", action="store_true")
    ap.add_argument("--fail-restores", type=int, default=0)
    args = ap.parse_args()
    dev = TensorDevice(args.size, args.block_on_restore) if args.tensor else Device(args.size, args.block_on_restore)
    fails = [args.fail_restores]
    gpu = rota.connect(args.group, args.job, args.orch)

    class Plugin:
        @rota.hookimpl
        def rota_park(self, tenant: object, plan: object) -> rota.ParkResult | None:
            if tenant is not gpu:
                return None
            dev.park()
            return rota.ParkResult(bytes_moved=args.size)

        @rota.hookimpl
        def rota_restore(self, tenant: object, plan: object) -> rota.ParkResult | None:
            if tenant is not gpu:
                return None
            if fails[0] > 0:
                fails[0] -= 1
                raise RuntimeError("injected restore failure (nothing moved)")
            dev.restore()
            return rota.ParkResult(bytes_moved=args.size)

        @rota.hookimpl
        def rota_footprint(self, tenant: object) -> dict[str, int] | None:
            return {"payload": args.size} if tenant is gpu and dev.device is not None else None

    gpu.pm.register(Plugin())
    client = register(gpu, args.agent).wait_registered() if args.agent else None
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        out: dict[str, object] = {"cmd": cmd}
        if cmd in ("acquire", "acquire-quiet"):
            try:
                g = gpu.acquire(quiet=cmd == "acquire-quiet")
                out.update(token=g.token, restored=g.context_restored, on_device=dev.device is not None)
            except rota.RotaError as exc:
                out.update(error=f"{type(exc).__name__}: {exc}")
        elif cmd == "release":
            out.update(deferred=gpu.release().snapshot_deferred)
        elif cmd == "check":
            intact = dev.intact if isinstance(dev, TensorDevice) else (dev.device or dev.host) == dev.payload
            out.update(parks=dev.parks, restores=dev.restores, on_device=dev.device is not None, intact=intact,
                       agent_commands=[k for k, ok, _ in client.commands if ok] if client else [],
                       client_restores=len(gpu.stats.restores), parked=gpu.parked,
                       events=[kind for kind, *_ in gpu.stats.events if kind != "wait"])
        elif cmd == "exit":
            break
        print(json.dumps(out), flush=True)
    if client is not None:
        client.close()
    gpu.close()


if __name__ == "__main__":
    main()
