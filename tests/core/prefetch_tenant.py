"""A tenant process for the prefetch tests, driven line by line over stdin/stdout (JSON).

Its "device state" is a bytes payload of ``--size`` bytes, reported as its footprint
while on the device; its park hook moves it to a host copy and its restore hook moves
it back. It is registered with a node agent, which parks and restores it on the
orchestrator's request (the path a prefetch takes for agent-held jobs).

    python prefetch_tenant.py --orch HOST:PORT --agent HOST:PORT --job J --group G --size N
                              [--block-on-restore FILE]
commands: acquire | release | check | exit. With --block-on-restore, a restore creates
FILE.started and then waits until FILE exists (so a test can act while it runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import rota
from rota_agent import register


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
        if self.block:
            open(self.block + ".started", "w").close()
            while not os.path.exists(self.block):
                time.sleep(0.01)
        if self.host is not None:
            self.device, self.host = self.host, None
            self.restores += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--orch", "--agent", "--job", "--group"):
        ap.add_argument(a, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--block-on-restore", default="")
    args = ap.parse_args()
    dev = Device(args.size, args.block_on_restore)
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
            dev.restore()
            return rota.ParkResult(bytes_moved=args.size)

        @rota.hookimpl
        def rota_footprint(self, tenant: object) -> dict[str, int] | None:
            return {"payload": args.size} if tenant is gpu and dev.device is not None else None

    gpu.pm.register(Plugin())
    client = register(gpu, args.agent).wait_registered()
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        out: dict[str, object] = {"cmd": cmd}
        if cmd == "acquire":
            try:
                g = gpu.acquire()
                out.update(token=g.token, restored=g.context_restored, on_device=dev.device is not None)
            except rota.RotaError as exc:
                out.update(error=f"{type(exc).__name__}: {exc}")
        elif cmd == "release":
            out.update(deferred=gpu.release().snapshot_deferred)
        elif cmd == "check":
            out.update(parks=dev.parks, restores=dev.restores, on_device=dev.device is not None,
                       intact=(dev.device or dev.host) == dev.payload,
                       agent_commands=[k for k, ok, _ in client.commands if ok])
        elif cmd == "exit":
            break
        print(json.dumps(out), flush=True)
    client.close()
    gpu.close()


if __name__ == "__main__":
    main()
