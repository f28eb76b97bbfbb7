"""A tenant process for the agent tests, driven line by line over stdin/stdout (JSON).

Its "device state" is a bytes payload that its park hook moves to a host list and
its restore hook moves back, so tests can see parks, restores and bit-identity.
``--mode fsdp`` instead tracks a real (CPU) torch model with rota_fsdp, and
``--leak-bytes N`` hangs an N-byte tensor off it that rota_fsdp does not park (a
"forgotten" tensor, reported as residue ``untracked:0.cache``).

    python tenant_proc.py --mode gpu|v1|fsdp --orch HOST:PORT --agent HOST:PORT --job J --group G
                          [--crash-on-park] [--fail-on-park] [--block-on-park FILE] [--block-on-restore FILE]
                          [--backend app_channel|noop|cuda] [--leak-bytes N] [--claim-pid PID]
commands: acquire | release | check | free (fsdp) | exit  (v1 mode needs no orchestrator unless acquire/release is sent)
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
from rota.wire import timeslice_orchestrator_pb2 as v1a
from rota.wire import timeslice_orchestrator_pb2_grpc as v1a_grpc
from rota_agent import WorkloadClient, register

PAYLOAD = hashlib.sha256(b"seed").digest() * 4096  # 128 KiB of "device" state


def _wait_for(path: str) -> None:
    while path and not os.path.exists(path):  # a hook that hangs until the test lets it go
        time.sleep(0.02)


class Device:
    def __init__(self, crash: bool, block: str, fail: bool = False, block_restore: str = "") -> None:
        self.device: bytes | None = PAYLOAD
        self.host: bytes | None = None
        self.parks = self.restores = 0
        self.crash, self.block, self.fail, self.block_restore = crash, block, fail, block_restore

    def park(self, *_: object) -> None:
        if self.crash:
            os._exit(17)  # dies mid-park, as a crashing tenant would
        if self.fail:
            raise RuntimeError("the device said no (--fail-on-park); nothing was moved")
        _wait_for(self.block)
        if self.device is not None:
            self.host, self.device = bytes(self.device), None
            self.parks += 1

    def restore(self, *_: object) -> None:
        _wait_for(self.block_restore)
        if self.host is not None:
            self.device, self.host = self.host, None
            self.restores += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--mode", "--orch", "--agent", "--job", "--group"):
        ap.add_argument(a, required=True)
    ap.add_argument("--crash-on-park", action="store_true")
    ap.add_argument("--block-on-park", default="")
    ap.add_argument("--fail-on-park", action="store_true")
    ap.add_argument("--block-on-restore", default="")
    ap.add_argument("--backend", default="app_channel")
    ap.add_argument("--leak-bytes", type=int, default=0)
    ap.add_argument("--claim-pid", type=int, default=None, help="v1 mode: send this as rota-pid (an attacker's claim)")
    args = ap.parse_args()
    dev = Device(args.crash_on_park, args.block_on_park, args.fail_on_park, args.block_on_restore)
    gpu = None
    model = None
    if args.mode == "fsdp":
        import torch

        import rota_fsdp

        torch.set_num_threads(1)
        gpu = rota.connect(args.group, args.job, args.orch)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64))
        rota_fsdp.track(gpu, model)
        if args.leak_bytes:
            model[0].cache = torch.ones(args.leak_bytes // 4)  # on the device, unknown to rota: it stays
        client = register(gpu, args.agent).wait_registered()
    elif args.mode == "gpu":
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
        client = WorkloadClient(args.agent, args.job, args.group, on_snapshot=dev.park, on_restore=dev.restore,
                                backend=args.backend, pid=args.claim_pid).wait_registered()
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
            if model is not None:
                out.update(parked=gpu.parked, weights_resident=all(  # type: ignore[union-attr]
                    p.untyped_storage().nbytes() > 0 for p in model.parameters()))
        elif cmd == "free" and model is not None:
            del model[0].cache  # the forgotten tensor is gone
        elif cmd == "exit":
            break
        print(json.dumps(out), flush=True)
    client.close()
    if gpu is not None:
        gpu.close()


if __name__ == "__main__":
    main()
