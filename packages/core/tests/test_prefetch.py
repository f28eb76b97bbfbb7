"""Prefetch: the next waiter is restored while the holder still runs, when it fits.

Real parts throughout: an orchestrator (and, for agent-held jobs, a node agent) on
loopback, and tenant processes (``prefetch_tenant.py``) whose park/restore hooks move
a payload, either through the agent or on their rota.v1 session's commands. Footprints
are in units of ``U`` bytes; the device holds ``3 * U``. The setup brings a group to
"a (2 U) holds, b (1 U) is parked": c (3 U, the whole device) held in between, which
parked b, and a's grant parked c.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner

from rota.errors import InvalidArgument
from rota.orchestrator import Orchestrator, OrchestratorConfig
from rota.testing import ScriptedProcess, eventually, running_orchestrator

HERE = os.path.dirname(os.path.abspath(__file__))
U = 64 << 10  # bytes per footprint unit


class Tenant(ScriptedProcess):
    """A prefetch_tenant.py process; every read has a timeout (a hang fails, never blocks the suite)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__(os.path.join(HERE, "prefetch_tenant.py"), args, env, timeout=60)


Cluster = tuple[Orchestrator, Callable[..., Tenant], str]


@pytest.fixture
def cluster(request, tmp_path) -> Iterator[Cluster]:
    """An agent, an orchestrator that knows it (device of 3 U, or ``request.param``), a tenant
    factory and the orchestrator's endpoint."""
    pytest.importorskip("rota_agent")
    from rota_agent import running_agent

    capacity = getattr(request, "param", 3 * U)
    env = _tenant_env(tmp_path)
    with running_agent() as (agent_ep, _):
        config = OrchestratorConfig(ttl_s=3.0, park_timeout_s=20.0, capacity_bytes=capacity, agents=(agent_ep,))
        with running_orchestrator(config) as (ep, engine), \
                _tenant_factory(env, "--orch", ep, "--agent", agent_ep) as start:
            yield engine, start, ep


@pytest.fixture
def sessions(tmp_path) -> Iterator[Cluster]:
    """No agent: an orchestrator (device of 3 U) that prefetches through tenants' rota.v1
    sessions, a tenant factory and the orchestrator's endpoint."""
    env = _tenant_env(tmp_path)
    config = OrchestratorConfig(ttl_s=3.0, park_timeout_s=20.0, capacity_bytes=3 * U)
    with running_orchestrator(config) as (ep, engine), _tenant_factory(env, "--orch", ep) as start:
        yield engine, start, ep


@contextlib.contextmanager
def _tenant_factory(env: dict[str, str], *common: str) -> Iterator[Callable[..., Tenant]]:
    """start(job, units, *extra) -> a tenant of group g with ``common`` arguments; all stopped at exit."""
    started: list[Tenant] = []

    def start(job: str, units: int, *extra: str) -> Tenant:
        t = Tenant([*common, "--job", job, "--group", "g", "--size", str(units * U), *extra], env)
        started.append(t)
        return t

    try:
        yield start
    finally:
        for t in started:
            t.stop()


def _tenant_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    env.update(ROTA_RUNTIME_DIR=str(tmp_path / "rt"), PYTHONUNBUFFERED="1", ROTA_LOAD_PLUGINS="")
    return env


def _bring_up_a_holds_b_parked(engine: Orchestrator, start: Callable[..., Tenant], *b_args: str
                               ) -> tuple[Tenant, Tenant, Tenant]:
    """b ran and was parked for c (whole device); a's grant parked c; a holds now."""
    b, c, a = start("b", 1, *b_args), start("c", 3), start("a", 2)
    assert b.ask("acquire")["restored"] is False
    b.ask("release")
    assert c.ask("acquire")["restored"] is False  # parks b: 1 + 3 > 3
    c.ask("release")
    assert a.ask("acquire")["restored"] is False  # parks c: 2 + 3 > 3
    tenants = engine.groups["g"].tenants
    assert (tenants["a"].state, tenants["b"].state, tenants["c"].state) == ("holding", "parked", "parked")
    return a, b, c


def _a_holds_b_parked(engine: Orchestrator, start: Callable[..., Tenant], *b_extra: str) -> tuple[Tenant, ...]:
    """The agent parked b (and c)."""
    a, b, c = _bring_up_a_holds_b_parked(engine, start, *b_extra)
    assert b.ask("check")["agent_commands"] == ["snapshot"]
    return a, b, c


def _b_prefetch_blocked(engine: Orchestrator, start: Callable[..., Tenant], gate: str) -> tuple[Tenant, ...]:
    """As _a_holds_b_parked; then b queues, and its prefetch restore is under way, held until ``gate`` exists."""
    a, b, c = _a_holds_b_parked(engine, start, "--block-on-restore", gate)
    b.send("acquire")
    eventually(lambda: os.path.exists(gate + ".started"), "b's prefetch under way")
    return a, b, c


def test_next_waiter_is_restored_while_the_holder_runs(cluster):
    engine, start, _ = cluster
    a, b, _ = _a_holds_b_parked(engine, start)
    g = engine.groups["g"]
    b.send("acquire")  # queues behind a; b (1 U) fits beside a (2 U): restored now, not at its grant
    eventually(lambda: g.tenants["b"].state == "resident", "b restored ahead of its grant")
    assert g.holder == "a" and g.tenants["a"].state == "holding"  # a never stopped holding
    assert g.residents == ["a", "b"] and g.tenants["c"].state == "parked"
    assert b.lines.empty(), "b was granted while a still held the group"
    assert a.ask("check")["agent_commands"] == []  # the holder was not touched

    a.ask("release")
    got = b.read()
    assert got["restored"] is False and got["on_device"] is True  # the grant needed no restore
    check = b.ask("check")
    assert check["agent_commands"] == ["snapshot", "restore"] and check["restores"] == 1 and check["intact"]
    assert (g.prefetch_hits, g.prefetch_misses, g.prefetch_failures) == (1, 0, 0)
    assert g.residents == ["a", "b"], "a was parked although both fit"
    b.ask("release")


@pytest.mark.parametrize("cluster", [2 * U + U // 2], indirect=True)
def test_no_prefetch_when_the_waiter_does_not_fit(cluster):
    """A device of 2.5 U: b (1 U) does not fit beside a (2 U), and nobody is evicted for a
    prefetch. The switch parks a and restores b before b's grant, as without prefetch."""
    engine, start, _ = cluster
    b, a = start("b", 1), start("a", 2)
    b.ask("acquire")
    b.ask("release")
    a.ask("acquire")  # parks b
    g = engine.groups["g"]
    assert g.tenants["b"].state == "parked"
    b.send("acquire")
    eventually(lambda: g.queued("b") is not None, "b queued")
    assert g.tenants["b"].state == "parked" and g.residents == ["a"]
    a.ask("release")
    got = b.read()
    assert got["restored"] is True and got["on_device"] is True  # restored at its grant
    assert a.ask("check")["agent_commands"] == ["snapshot"] and a.ask("check")["intact"]
    assert b.ask("check")["agent_commands"] == ["snapshot", "restore"]
    assert (g.prefetch_hits, g.prefetch_misses) == (0, 1)
    b.ask("release")


def test_waiter_that_dies_during_its_prefetch_does_not_stall_the_group(cluster, tmp_path):
    engine, start, _ = cluster
    a, b, c = _b_prefetch_blocked(engine, start, str(tmp_path / "never"))
    g = engine.groups["g"]
    c.send("acquire")
    eventually(lambda: g.queued("c") is not None, "c queued")
    b.proc.kill()  # mid-restore
    eventually(lambda: g.tenants["b"].state == "lost", "b's death noticed")
    a.ask("release")
    got = c.read()  # the group moves on to c: no wait for b's restore or the park timeout
    assert got["restored"] is True and got["on_device"] is True
    assert g.holder == "c" and "b" not in g.residents and not g.prefetched
    assert a.ask("check")["agent_commands"] == ["snapshot"]  # parked for c (3 U), after its turn
    c.ask("release")


def test_waiter_evicted_during_its_prefetch(cluster, tmp_path):
    """A scheduler evicts b while its prefetch runs. b's client retries its acquire (the
    eviction answers UNAVAILABLE) and queues again; the restore that was under way
    finishes and counts for that new wait, so b's grant needs no second restore."""
    engine, start, endpoint = cluster
    gate = str(tmp_path / "gate")
    a, b, _ = _b_prefetch_blocked(engine, start, gate)
    g = engine.groups["g"]
    _evict(endpoint, "b")
    eventually(lambda: g.tenants["b"].state == "waiting", "b queued again by its client")
    assert g.holder == "a" and "b" not in g.residents
    open(gate, "w").close()  # let b's restore finish
    eventually(lambda: g.tenants["b"].state == "resident", "b's finished restore recorded")
    assert g.holder == "a" and g.prefetched == ["b"]
    a.ask("release")
    got = b.read()
    assert got["restored"] is False and got["on_device"] is True and "error" not in got
    assert b.ask("check")["agent_commands"] == ["snapshot", "restore"]
    assert (g.prefetch_hits, g.prefetch_failures) == (1, 0)
    b.ask("release")


def _evict(endpoint: str, job: str) -> None:
    """What a scheduler plugin does when it sees a job end: rota.v1 Evict over gRPC."""
    import grpc

    from rota.wire import rota_v1_pb2 as pb
    from rota.wire import rota_v1_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoint) as ch:
        pb_grpc.RotaServiceStub(ch).Evict(pb.EvictRequest(job_id=job, group_id="g", reason="job ended"), timeout=10)


# ------------------------------------------------- rota.v1 sessions (no agent)


def _session_a_holds_b_parked(engine: Orchestrator, start: Callable[..., Tenant], *b_extra: str
                              ) -> tuple[Tenant, Tenant]:
    """As _a_holds_b_parked, with every park a session command to the tenant's client."""
    a, b, _ = _bring_up_a_holds_b_parked(engine, start, "--tensor", *b_extra)
    check = b.ask("check")
    assert check["parked"] and not check["on_device"] and check["intact"] and check["events"][-1] == "park"
    assert [s.can_prefetch for s in engine._sessions[("g", "b")]] == [True]  # its hello said so
    return a, b


def test_session_tenant_is_restored_ahead_of_its_grant(sessions):
    """rota.connect() with no agent: the orchestrator sends b's client a restore command
    while a holds; b's tensors come back before its grant, which restores nothing."""
    from rota.cli.main import cli

    engine, start, endpoint = sessions
    a, b = _session_a_holds_b_parked(engine, start)
    g = engine.groups["g"]
    b.send("acquire")  # queues behind a; b (1 U) fits beside a (2 U)
    eventually(lambda: g.tenants["b"].state == "resident", "b restored ahead of its grant")
    assert g.holder == "a" and g.tenants["a"].state == "holding" and g.residents == ["a", "b"]
    assert b.lines.empty(), "b was granted while a still held the group"
    a.ask("release")
    got = b.read()
    assert got["restored"] is False and got["on_device"] is True  # the grant needed no restore
    check = b.ask("check")
    assert check["client_restores"] == 1 and check["restores"] == 1 and check["intact"]
    assert check["events"][-2:] == ["park", "restore"], check["events"]  # the restore came before the grant
    assert (g.prefetch_hits, g.prefetch_misses, g.prefetch_failures, g.prefetch_wasted) == (1, 0, 0, 0)
    assert a.ask("check")["events"] == ["turn"], "the holder was parked or restored"

    shown = CliRunner().invoke(cli, ["status", "g", "--orchestrator", endpoint, "--json"])
    assert shown.exit_code == 0, shown.output
    group = json.loads(shown.output)["groups"][0]
    assert group["prefetch_hits"] == 1 and group["prefetch_failures"] == 0  # numbers, every key present
    table = CliRunner().invoke(cli, ["status", "g", "--orchestrator", endpoint])
    assert "prefetch  hit=1  miss=0  failed=0  wasted=0" in table.output, table.output
    metrics = CliRunner().invoke(cli, ["status", "g", "--orchestrator", endpoint, "--prometheus"])
    assert 'rota_group_prefetches_total{group="g",outcome="hit"} 1.0' in metrics.output
    assert 'rota_group_prefetches_total{group="g",outcome="failed"} 0.0' in metrics.output
    b.ask("release")


def test_prefetch_parks_an_idle_resident_to_make_room(sessions):
    """Device of 3 U: a (1 U) holds, b (2 U) sits idle on the device, c (2 U) waits parked.
    c fits only without b, so during a's turn b is parked and c restored: the grant that
    follows moves nothing, and a is never touched."""
    engine, start, _ = sessions
    c, b, a = start("c", 2, "--tensor"), start("b", 2, "--tensor"), start("a", 1, "--tensor")
    for t in (c, b):  # c runs, then b's grant parks c (2 + 2 > 3)
        t.ask("acquire")
        t.ask("release")
    a.ask("acquire")  # fits beside b: nothing parked
    g = engine.groups["g"]
    assert g.holder == "a" and g.residents == ["b", "a"] and g.tenants["c"].state == "parked"
    c.send("acquire")
    eventually(lambda: g.tenants["c"].state == "resident", "c restored ahead of its grant")
    assert g.holder == "a" and g.tenants["b"].state == "parked" and g.residents == ["a", "c"]
    assert c.lines.empty(), "c was granted while a still held the group"
    a.ask("release")
    got = c.read()
    assert got["restored"] is False and got["on_device"] is True
    assert c.ask("check")["intact"] and b.ask("check")["events"][-1] == "park"
    assert a.ask("check")["events"] == ["turn"], "the holder was parked or restored"
    assert (g.prefetch_hits, g.prefetch_misses, g.prefetch_failures) == (1, 0, 0)
    c.ask("release")
    b.ask("acquire")  # parked by the prefetch, restored at its own grant, bytes intact
    assert b.ask("check")["intact"]
    b.ask("release")


def test_prefetch_never_parks_a_job_that_waits_for_a_turn(sessions):
    """As above, but b queues for a turn before c: b is the next grant, and c may not push it
    out. b is already resident; nothing is parked during a's turn."""
    engine, start, _ = sessions
    c, b, a = start("c", 2, "--tensor"), start("b", 2, "--tensor"), start("a", 1, "--tensor")
    for t in (c, b):
        t.ask("acquire")
        t.ask("release")
    a.ask("acquire")
    g = engine.groups["g"]
    b.send("acquire")
    eventually(lambda: g.queued("b") is not None, "b queued")
    c.send("acquire")
    eventually(lambda: g.queued("c") is not None, "c queued")
    assert g.residents == ["b", "a"] and g.tenants["c"].state == "parked" and not g.prefetched
    a.ask("release")
    assert b.read()["restored"] is False
    b.ask("release")
    assert c.read()["on_device"] is True
    c.ask("release")


def test_no_prefetch_while_the_holder_is_quiet(sessions):
    """Device of 3 U. a (2 U) holds a quiet turn (``turn(quiet=True)``: e.g. a vLLM engine profiling
    free memory as it starts) while b (1 U) waits parked: b would fit beside a, but nothing is
    prefetched; b is restored at its own grant. In b's ordinary turn that follows, parked c (2 U) is
    prefetched as usual (idle a parked to make room)."""
    engine, start, _ = sessions
    b, c, a = start("b", 1, "--tensor"), start("c", 2, "--tensor"), start("a", 2, "--tensor")
    for t in (b, c):  # both fit: 1 + 2 <= 3
        t.ask("acquire")
        t.ask("release")
    assert a.ask("acquire-quiet")["restored"] is False  # parks b and c: 2 + 1 + 2 > 3
    g = engine.groups["g"]
    assert g.holder == "a" and g.holder_quiet and g.residents == ["a"]
    b.send("acquire")  # an ordinary turn would restore b now (see test_session_tenant_is_restored_ahead_...)
    eventually(lambda: g.queued("b") is not None, "b queued")
    time.sleep(0.5)  # the driver that b's acquire kicked has run, or runs now
    eventually(lambda: engine._drivers["g"].done(), "the group's driver idle")
    assert "g" not in engine._prefetching and not g.prefetched, "a prefetch started during a quiet turn"
    assert g.tenants["b"].state == "parked" and g.residents == ["a"] and b.lines.empty()
    assert a.ask("check")["events"] == [], "the holder was parked or restored"

    a.ask("release")
    got = b.read()
    assert got["restored"] is True and got["on_device"] is True  # restored at its grant, as without prefetch
    assert not g.holder_quiet and (g.prefetch_hits, g.prefetch_misses) == (0, 1)
    c.send("acquire")  # b's turn is not quiet: c is prefetched, idle a parked for it
    eventually(lambda: g.tenants["c"].state == "resident", "c restored ahead of its grant")
    assert g.holder == "b" and g.tenants["a"].state == "parked" and g.residents == ["b", "c"]
    b.ask("release")
    got = c.read()
    assert got["restored"] is False and got["on_device"] is True and c.ask("check")["intact"]
    assert (g.prefetch_hits, g.prefetch_misses, g.prefetch_failures) == (1, 1, 0)
    c.ask("release")


def test_session_prefetch_that_fails_leaves_the_state_parked(sessions):
    """b's restore raises (rolled back): the prefetch is reported failed, b stays parked
    and queued, is not asked again this turn, and its grant restores it as usual."""
    engine, start, _ = sessions
    a, b = _session_a_holds_b_parked(engine, start, "--fail-restores", "1")
    g = engine.groups["g"]
    b.send("acquire")
    eventually(lambda: g.prefetch_failures == 1, "b's prefetch reported failed")
    assert g.tenants["b"].state == "parked" and g.queued("b") is not None and g.residents == ["a"]
    assert g.holder == "a" and b.lines.empty() and not g.tenants["b"].fault  # b waits in acquire, still parked
    a.ask("release")
    got = b.read()
    assert got["restored"] is True and got["on_device"] is True and "error" not in got
    check = b.ask("check")
    assert check["client_restores"] == 1 and check["restores"] == 1 and check["intact"]
    assert (g.prefetch_hits, g.prefetch_misses, g.prefetch_failures) == (0, 1, 1)
    b.ask("release")


class OldSession:
    """A rota.v1 tenant from before prefetch, on the raw stubs: its hello has no
    can_prefetch. It acknowledges parks and records every command it is sent."""

    def __init__(self, endpoint: str, job: str, footprint: int) -> None:
        import grpc

        from rota.wire import rota_v1_pb2 as pb
        from rota.wire import rota_v1_pb2_grpc as pb_grpc

        self.pb, self.job, self.footprint = pb, job, footprint
        self.channel = grpc.insecure_channel(endpoint)
        self.stub = pb_grpc.RotaServiceStub(self.channel)
        self.out: queue.Queue = queue.Queue()
        self.commands: list[str] = []
        self.attached = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        assert self.attached.wait(30), "old session never attached"

    def _messages(self) -> Iterator[object]:
        pb = self.pb
        yield pb.TenantMessage(hello=pb.Hello(job_id=self.job, group_id="g", pid=os.getpid(),
                                              footprint_bytes=self.footprint))
        while True:
            try:
                msg = self.out.get(timeout=0.2)
            except queue.Empty:
                msg = pb.TenantMessage(heartbeat=pb.Heartbeat(footprint_bytes=self.footprint))
            if msg is None:
                return
            yield msg

    def _read(self) -> None:
        import grpc

        try:
            for cmd in self.stub.Attach(self._messages()):
                kind = cmd.WhichOneof("command") or "attached"
                self.commands.append(kind)
                if kind == "attached":
                    self.attached.set()
                elif kind == "park":
                    self.out.put(self.pb.TenantMessage(result=self.pb.CommandResult(
                        command_id=cmd.command_id, ok=True, bytes=self.footprint)))
        except grpc.RpcError:
            pass

    def acquire(self) -> object:
        return self.stub.Acquire(self.pb.TurnRequest(job_id=self.job, group_id="g", footprint_bytes=self.footprint),
                                 timeout=60)

    def release(self, token: int) -> None:
        self.stub.Release(self.pb.ReleaseRequest(job_id=self.job, group_id="g", token=token), timeout=10)

    def close(self) -> None:
        self.out.put(None)
        self.reader.join(10)
        self.channel.close()


def test_old_session_client_is_never_sent_a_restore(sessions):
    """A client whose hello lacks can_prefetch cannot handle a restore command: the
    orchestrator never sends one, and restores it at its grant as before prefetch."""
    engine, start, endpoint = sessions
    g = engine.groups
    b = OldSession(endpoint, "b", U)
    try:
        c, a = start("c", 3), start("a", 2)
        b.release(b.acquire().token)
        c.ask("acquire")  # parks b (a park command on its session)
        c.ask("release")
        a.ask("acquire")  # parks c
        assert [s.can_prefetch for s in engine._sessions[("g", "b")]] == [False]
        assert g["g"].tenants["b"].state == "parked" and b.commands == ["attached", "park"]
        got: dict[str, object] = {}
        waiter = threading.Thread(target=lambda: got.update(grant=b.acquire()))
        waiter.start()
        eventually(lambda: g["g"].queued("b") is not None, "b queued")
        assert g["g"].tenants["b"].state == "parked" and g["g"].residents == ["a"]
        a.ask("release")
        waiter.join(60)
        grant = got["grant"]
        assert grant.context_restored is True  # restored at its grant, by the switch
        assert b.commands == ["attached", "park"], b.commands  # no restore command, before or at the grant
        assert (g["g"].prefetch_hits, g["g"].prefetch_misses, g["g"].prefetch_failures) == (0, 1, 0)
        b.release(grant.token)
    finally:
        b.close()


# ------------------------------------------------------------------ config


def test_prefetch_config_is_validated():
    assert OrchestratorConfig().prefetch_on is False  # device size unknown: never
    assert OrchestratorConfig(capacity_bytes=U).prefetch_on is True  # default on with a size
    assert OrchestratorConfig(capacity_bytes=U, prefetch=False).prefetch_on is False
    with pytest.raises(InvalidArgument, match=r"prefetch=True needs the device size.*--capacity"):
        OrchestratorConfig(prefetch=True).check()
    with pytest.raises(InvalidArgument, match=r"prefetch='yes' must be True, False or None"):
        OrchestratorConfig(capacity_bytes=U, prefetch="yes").check()  # type: ignore[arg-type]


def test_quiet_must_be_a_bool(orchestrator):
    """``turn(quiet="yes")`` is refused before anything is asked, naming the value; so is an in-process
    orchestrator's request with such a flag."""
    import asyncio

    import rota
    from rota.types import TurnRequest

    endpoint, engine = orchestrator
    with rota.connect(group="q", tenant="a", endpoint=endpoint) as gpu:
        with pytest.raises(InvalidArgument, match=r"quiet='yes' must be True or False"), gpu.turn(quiet="yes"):
            pass
        assert gpu.grant is None and "q" not in engine.groups
        with gpu.turn(quiet=True):
            assert engine.groups["q"].holder_quiet
        assert not engine.groups["q"].holder_quiet
    with pytest.raises(InvalidArgument, match=r"quiet=1 must be True or False \(job='a', group='q'\)"):
        asyncio.run(Orchestrator(OrchestratorConfig()).acquire(TurnRequest("a", "q", quiet=1)))  # type: ignore


def test_prefetch_flag_on_the_cli():
    from rota.cli.main import cli

    runner = CliRunner()
    helped = runner.invoke(cli, ["orchestrator", "serve", "--help"])
    assert helped.exit_code == 0 and "--prefetch / --no-prefetch" in helped.output
    bad = runner.invoke(cli, ["orchestrator", "serve", "--prefetch", "--listen", "127.0.0.1:1"])
    assert bad.exit_code == 2 and "prefetch=True needs the device size" in bad.output


# ------------------------------------------------------------ tenant side


def test_client_restore_ahead_of_grant_is_not_repeated_at_the_grant(orchestrator):
    """The client's handler of a "restore" session command (prefetch by the tenant itself)
    runs the same restore as a grant does, in a background thread; the grant that follows
    finds nothing parked. Called directly here; the session tests above send it over rota.v1."""
    import rota
    from rota.testing import ListState

    endpoint, _ = orchestrator
    a = rota.connect(group="pf", tenant="a", endpoint=endpoint)
    b = rota.connect(group="pf", tenant="b", endpoint=endpoint)
    sa = ListState(a)
    a.acquire()
    a.release()
    b.acquire()  # parks a
    assert sa.calls == ["park"] and a.parked
    worker = threading.Thread(target=a._prefetch, args=("cmd-1", 0))
    worker.start()
    worker.join(30)
    assert sa.calls == ["park", "restore"] and not a.parked and sa.device == list(range(10))
    b.release()
    a.acquire()
    assert sa.calls == ["park", "restore"], "restored a second time at the grant"
    assert [kind for kind, *_ in a.stats.events].count("restore") == 1
    a.release()
    for x in (sa, a, b):
        x.close()
