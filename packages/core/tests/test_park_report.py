"""A park is reported once: its result carries the memory it left, and heartbeats do not repeat it.

Real clients (``rota.Gpu``) and a real orchestrator over loopback gRPC. The orchestrator's
``heartbeat`` and ``command_result`` are wrapped to record, in arrival order, every report of a
tenant's memory (host, spilled, residue bytes) and every command result. Older peers still
interoperate: a client that never sends the memory with its results is heard through its
heartbeats as before, and a client attached to an orchestrator that does not say ``memory_once``
keeps sending the memory in every heartbeat.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

import rota
from rota.testing import ListState, eventually
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc

HOST, RESIDUE = 4096, 512  # what a's park leaves: host memory behind it, device bytes left behind


class HostState(ListState):
    """A ListState whose park keeps ``HOST`` bytes of host memory and leaves ``RESIDUE`` on the device."""

    @rota.hookimpl
    def rota_park(self, tenant: rota.Gpu, plan: rota.ParkPlan) -> rota.ParkResult | None:
        result = super().rota_park(tenant, plan)
        if result is not None:
            result.host_bytes = HOST
        return result


@pytest.fixture
def reports(orchestrator, monkeypatch):
    """(endpoint, orchestrator, reports): reports lists ("memory", job, (host, spilled, residue)) for each
    memory a session reported and ("result", command_id) for each command result, as they arrived."""
    endpoint, engine = orchestrator
    seen: list[tuple] = []
    heartbeat, command_result = engine.heartbeat, engine.command_result

    def heard(s, footprint_bytes, memory=None):
        if memory is not None:
            seen.append(("memory", s.job_id, memory))
        seen.append(("alive", s.job_id))
        heartbeat(s, footprint_bytes, memory)

    def result(command_id, *args):
        seen.append(("result", command_id))
        command_result(command_id, *args)

    monkeypatch.setattr(engine, "heartbeat", heard)
    monkeypatch.setattr(engine, "command_result", result)
    return endpoint, engine, seen


def memory_of(seen: list[tuple], job: str) -> list[tuple[int, int, int]]:
    return [r[2] for r in seen if r[0] == "memory" and r[1] == job]


def heard_from(seen: list[tuple], job: str) -> int:
    return sum(1 for r in seen if r[0] == "alive" and r[1] == job)


def test_a_park_is_reported_once_with_its_result(reports, monkeypatch):
    monkeypatch.setenv("ROTA_HEARTBEAT_S", "0.02")  # many heartbeats: none may repeat the park
    endpoint, engine, seen = reports
    a = rota.connect(group="g", tenant="a", endpoint=endpoint)
    b = rota.connect(group="g", tenant="b", endpoint=endpoint)
    sa, sb = HostState(a, leaves=RESIDUE), ListState(b)
    try:
        a.acquire()
        a.release()  # resident
        eventually(lambda: memory_of(seen, "a") == [(0, 0, 0)], "a's first heartbeat reports its memory")
        b.acquire()  # parks a
        rec = engine.groups["g"].tenants["a"]
        # recorded with the park's result, before b's grant (no heartbeat needed)
        assert (rec.state, rec.host_bytes, rec.residue_bytes) == ("parked", HOST, RESIDUE)
        at = seen.index(("memory", "a", (HOST, 0, RESIDUE)))
        assert seen[at + 1] == ("alive", "a") and seen[at + 2][0] == "result"  # it came in the result
        heard = heard_from(seen, "a")
        eventually(lambda: heard_from(seen, "a") >= heard + 20, "twenty more heartbeats of a")
        assert memory_of(seen, "a") == [(0, 0, 0), (HOST, 0, RESIDUE)]  # none repeated the park
        assert len(rec.parks_ms) == 1 and rec.parked_bytes == 1000
        b.release()
        a.acquire()  # restored at its grant: the residue is gone, a change its next heartbeat reports once
        eventually(lambda: memory_of(seen, "a")[-1] == (HOST, 0, 0), "a's heartbeat reports the restore")
        heard = heard_from(seen, "a")
        eventually(lambda: heard_from(seen, "a") >= heard + 20, "twenty more heartbeats of a")
        assert memory_of(seen, "a") == [(0, 0, 0), (HOST, 0, RESIDUE), (HOST, 0, 0)]
        assert rec.residue_bytes == 0
        a.release()
    finally:
        for x in (sa, sb, a, b):
            x.close()


class OlderClient:
    """A rota.v1 tenant from before CommandResult.memory, on the raw stubs: its heartbeats always carry
    its memory, its results never do."""

    def __init__(self, endpoint: str) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.out: queue.Queue = queue.Queue()
        self.attached = threading.Event()
        self.calls = pb_grpc.RotaServiceStub(self.channel).Attach(self._messages())
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        assert self.attached.wait(30), "the older client never attached"

    def _messages(self) -> Iterator[pb.TenantMessage]:
        yield pb.TenantMessage(hello=pb.Hello(job_id="old", group_id="g", pid=1))
        while (msg := self.out.get()) is not None:
            yield msg

    def _read(self) -> None:
        try:
            for cmd in self.calls:
                if cmd.command_id == "attached":
                    self.attached.set()
        except grpc.RpcError:
            pass

    def send(self, **message: object) -> None:
        self.out.put(pb.TenantMessage(**message))

    def close(self) -> None:
        self.out.put(None)
        self.reader.join(10)
        self.channel.close()


def test_an_older_client_is_heard_through_its_heartbeats(reports):
    endpoint, engine, seen = reports
    old = OlderClient(endpoint)
    try:
        old.send(heartbeat=pb.Heartbeat(footprint_bytes=1000, host_bytes=HOST, residue_bytes=RESIDUE))
        eventually(lambda: memory_of(seen, "old") == [(HOST, 0, RESIDUE)], "the heartbeat's memory")
        old.send(result=pb.CommandResult(command_id="x", ok=True, bytes=1000))  # no memory: none is changed
        eventually(lambda: ("result", "x") in seen, "the result")
        rec = engine.groups["g"].tenants["old"]
        assert (rec.host_bytes, rec.residue_bytes) == (HOST, RESIDUE)
        old.send(heartbeat=pb.Heartbeat(footprint_bytes=1000, host_bytes=HOST))  # every heartbeat is read
        eventually(lambda: rec.residue_bytes == 0, "the next heartbeat's memory")
    finally:
        old.close()


class OlderOrchestrator(pb_grpc.RotaServiceServicer):
    """A fake orchestrator from before ``memory_once`` (no real one of that version runs here): it attaches
    tenants without saying it, records every message they send and can send a park command."""

    def __init__(self) -> None:
        self.messages: list[pb.TenantMessage] = []
        self.commands: queue.Queue = queue.Queue()

    def Attach(self, request_iterator, context):
        threading.Thread(target=lambda: self.messages.extend(request_iterator), daemon=True).start()
        yield pb.TenantCommand(command_id="attached", resume="0" * 32)
        while context.is_active():
            try:
                yield self.commands.get(timeout=0.1)
            except queue.Empty:
                continue


def test_a_client_keeps_reporting_memory_to_an_orchestrator_that_does_not_say_memory_once(monkeypatch):
    monkeypatch.setenv("ROTA_HEARTBEAT_S", "0.02")
    older = OlderOrchestrator()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_RotaServiceServicer_to_server(older, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    gpu = rota.connect(group="g", tenant="a", endpoint=f"127.0.0.1:{port}")
    state = HostState(gpu, leaves=RESIDUE)
    try:
        eventually(lambda: older.messages, "the client's first messages")
        older.commands.put(pb.TenantCommand(command_id="p", park=pb.ParkCommand(token=1)))
        eventually(lambda: any(m.WhichOneof("message") == "result" for m in older.messages), "the park's result")
        after = len(older.messages)
        eventually(lambda: len(older.messages) >= after + 10, "ten more heartbeats")
        beats = [m.heartbeat for m in older.messages if m.WhichOneof("message") == "heartbeat"]
        assert beats and not any(b.memory_unchanged for b in beats)  # it would not read a heartbeat without them
        later = [m.heartbeat for m in older.messages[after:] if m.WhichOneof("message") == "heartbeat"]
        assert all((b.host_bytes, b.residue_bytes) == (HOST, RESIDUE) for b in later)
    finally:
        state.close()
        gpu.close()
        server.stop(0)
