"""A tenant process for the agent tests, driven line by line over stdin/stdout (JSON).

Its "device state" is a bytes payload that its park hook moves to a host list and
its restore hook moves back, so tests can see parks, restores and bit-identity.

    python tenant_proc.py --mode gpu|v1 --orch HOST:PORT --agent HOST:PORT --job J --group G
                          [--crash-on-park] [--block-on-park FILE]
commands: acquire | release | check | exit
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import grpc

import rota
from rota._generated import timeslice_orchestrator_pb2 as v1a
from rota._generated import timeslice_orchestrator_pb2_grpc as v1a_grpc
from rota_agent import WorkloadClient, register

PAYLOAD = hashlib.sha256(b"seed").digest() * 4096  # 128 KiB of "device" state


class Device:
    def __init__(self, crash: bool, block: str) -> None:
        self.device: bytes | None = PAYLOAD
        self.host: bytes | None = None
        self.parks = self.restores = 0
        self.crash, self.block = crash, block

    def park(self, *_: object) -> None:
        if self.crash:
            os._exit(17)  # dies mid-park, as a crashing tenant would
        while self.block and not os.path.exists(self.block):
            time.sleep(0.02)
        if self.device is not None:
            self.host, self.device = bytes(self.device), None
            self.parks += 1

    def restore(self, *_: object) -> None:
        if self.host is not None:
            self.device, self.host = self.host, None
            self.restores += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--mode", "--orch", "--agent", "--job", "--group"):
        ap.add_argument(a, required=True)
    ap.add_argument("--crash-on-park", action="store_true")
    ap.add_argument("--block-on-park", default="")
    args = ap.parse_args()
    dev = Device(args.crash_on_park, args.block_on_park)
    gpu = None
    if args.mode == "gpu":
        gpu = rota.connect(args.group, args.job, args.orch)

        class Plugin:
            @rota.hookimpl
            def rota_park(self, tenant: object, plan: object) -> rota.ParkResult | None:
                if tenant is gpu:
                    dev.park()
                    return rota.ParkResult(bytes_moved=len(PAYLOAD))
                return None

            @rota.hookimpl
            def rota_restore(self, tenant: object, plan: object) -> rota.ParkResult | None:
                if tenant is gpu:
                    dev.restore()
                    return rota.ParkResult(bytes_moved=len(PAYLOAD))
                return None

        gpu.pm.register(Plugin())
        client = register(gpu, args.agent).wait_registered()
    else:
        stub = v1a_grpc.TimeSliceOrchestratorServiceStub(grpc.insecure_channel(args.orch))
        client = WorkloadClient(args.agent, args.job, args.group, on_snapshot=dev.park,
                                on_restore=dev.restore).wait_registered()
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        out: dict[str, object] = {"cmd": cmd}
        if cmd == "acquire":
            if gpu is not None:
                g = gpu.acquire()
                out.update(token=g.token, restored=g.context_restored)
            else:
                r = stub.Acquire(v1a.AcquireRequest(job_id=args.job, group_id=args.group), timeout=60)
                out.update(restored=r.context_restored)
            out.update(on_device=dev.device is not None)
        elif cmd == "release":
            if gpu is not None:
                out.update(deferred=gpu.release().snapshot_deferred)
            else:
                stub.Yield(v1a.YieldRequest(job_id=args.job, group_id=args.group), timeout=10)
        elif cmd == "check":
            out.update(parks=dev.parks, restores=dev.restores, on_device=dev.device is not None,
                       identical=(dev.device or dev.host) == PAYLOAD,
                       agent_commands=[k for k, ok, _ in client.commands if ok])
        elif cmd == "exit":
            break
        print(json.dumps(out), flush=True)
    client.close()
    if gpu is not None:
        gpu.close()


if __name__ == "__main__":
    main()
