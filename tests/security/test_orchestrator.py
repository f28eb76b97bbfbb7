"""Issue 17, rows 1-12 and 24: attacks on the orchestrator, each driven against a real server.

The orchestrator here checks bearer tokens (``ServerAuth(key=...)``), as ``rota orchestrator
serve --auth-key`` does. ``victim`` is a job of group ``g``; the attacker holds a valid token
for its own job ``mallory`` of the same group (another team sharing the GPUs). Each test
shows the attack is refused with the right status and that the victim's state is unchanged.
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time

import grpc
import pytest

import rota
from rota import auth
from rota.orchestrator import OrchestratorConfig
from rota.testing import running_orchestrator
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc
from rota.wire import timeslice_orchestrator_pb2 as v1a
from rota.wire import timeslice_orchestrator_pb2_grpc as v1a_grpc

KEY = b"k" * 32


def token(job: str = "", group: str = "g", *, admin: bool = False) -> str:
    return auth.issue(KEY, admin=True) if admin else auth.issue(KEY, group=group, job=job)


@pytest.fixture
def served():
    config = OrchestratorConfig(ttl_s=3.0, park_timeout_s=10.0, idle_group_ttl_s=1.0, ended_tenant_ttl_s=1.0)
    with running_orchestrator(config, auth=auth.ServerAuth(key=KEY)) as s:
        yield s


@pytest.fixture
def victim_holds(served):
    """The victim (a real rota.v1 client with its token) holds group g."""
    endpoint, engine = served
    victim = rota.connect(group="g", tenant="victim", endpoint=endpoint, token=token("victim"))
    grant = victim.acquire()
    yield endpoint, engine, victim, grant
    victim.close()


def stub(endpoint: str, tok: str | None) -> pb_grpc.RotaServiceStub:
    return pb_grpc.RotaServiceStub(auth.channel(endpoint, token=tok or ""))


def v1alpha1(endpoint: str, tok: str | None) -> v1a_grpc.TimeSliceOrchestratorServiceStub:
    return v1a_grpc.TimeSliceOrchestratorServiceStub(auth.channel(endpoint, token=tok or ""))


def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, (err.value.code(), err.value.details())
    return err.value.details() or ""


def unchanged(engine, grant) -> None:
    g = engine.groups["g"]
    assert (g.holder, g.token) == ("victim", grant.token)
    assert g.tenants["victim"].state == "holding"


def test_row1_v1alpha1_yield_for_another_job_is_refused(victim_holds):
    endpoint, engine, _, grant = victim_holds
    y = v1a.YieldRequest(job_id="victim", group_id="g")
    refused(lambda: v1alpha1(endpoint, token("mallory")).Yield(y, timeout=5), grpc.StatusCode.PERMISSION_DENIED)
    refused(lambda: v1alpha1(endpoint, None).Yield(y, timeout=5), grpc.StatusCode.UNAUTHENTICATED)
    unchanged(engine, grant)


def test_row2_release_with_token_zero_is_no_bypass(victim_holds):
    endpoint, engine, _, grant = victim_holds
    r = pb.ReleaseRequest(job_id="victim", group_id="g", token=0)
    refused(lambda: stub(endpoint, token("mallory")).Release(r, timeout=5), grpc.StatusCode.PERMISSION_DENIED)
    refused(lambda: stub(endpoint, token("victim")).Release(r, timeout=5), grpc.StatusCode.INVALID_ARGUMENT)
    unchanged(engine, grant)


def test_row3_a_wrong_token_does_not_reveal_the_real_one(victim_holds):
    endpoint, engine, victim, grant = victim_holds
    for _ in range(6):  # make the current token a number that would stand out
        victim.release()
        grant = victim.acquire()
    r = pb.ReleaseRequest(job_id="victim", group_id="g", token=999)
    refused(lambda: stub(endpoint, token("mallory")).Release(r, timeout=5), grpc.StatusCode.PERMISSION_DENIED)
    details = refused(lambda: stub(endpoint, token("victim")).Release(r, timeout=5),
                      grpc.StatusCode.FAILED_PRECONDITION)
    assert str(grant.token) not in details.replace("999", "")
    seen = stub(endpoint, token("mallory")).Status(pb.StatusRequest(group_id="g"), timeout=5).groups[0]
    assert seen.token == 0 and seen.holder == "(another job)" and "victim" not in str(seen)
    unchanged(engine, grant)


def test_row4_evict_by_another_tenant_is_refused_and_by_an_admin_allowed(victim_holds):
    endpoint, engine, _, grant = victim_holds
    e = pb.EvictRequest(job_id="victim", group_id="g", reason="mine now")
    refused(lambda: stub(endpoint, token("mallory")).Evict(e, timeout=5), grpc.StatusCode.PERMISSION_DENIED)
    unchanged(engine, grant)
    assert stub(endpoint, token(admin=True)).Evict(e, timeout=5).was_holder  # the scheduler's right


def _attach(endpoint: str, tok: str, job: str, pid: int, messages=()) -> list:
    def requests():
        yield pb.TenantMessage(hello=pb.Hello(job_id=job, group_id="g", rank=0, world_size=1, pid=pid))
        yield from messages
    return list(stub(endpoint, tok).Attach(requests(), timeout=5))


def test_row5_attach_as_another_job_is_refused(victim_holds):
    endpoint, engine, _, grant = victim_holds
    refused(lambda: _attach(endpoint, token("mallory"), "victim", 4242), grpc.StatusCode.PERMISSION_DENIED)
    time.sleep(0.5)  # the closed stream must not have been taken for the victim's death
    unchanged(engine, grant)


def test_row6_a_second_session_for_a_live_rank_does_not_displace_it(victim_holds):
    endpoint, engine, _victim, grant = victim_holds
    refused(lambda: _attach(endpoint, token("mallory"), "victim", 4242), grpc.StatusCode.PERMISSION_DENIED)
    # even with the victim's own token (leaked to another process), a second session is refused
    refused(lambda: _attach(endpoint, token("victim"), "victim", os.getpid() + 1), grpc.StatusCode.ALREADY_EXISTS)
    assert len(engine._live_sessions(("g", "victim"))) == 1
    unchanged(engine, grant)


def _first_reply(endpoint: str, tok: str, job: str, pid: int, resume: str) -> object:
    """Open an Attach stream with ``resume`` and return its first reply (the "attached" message), then hang up."""
    def requests():
        yield pb.TenantMessage(hello=pb.Hello(job_id=job, group_id="g", rank=0, world_size=1, pid=pid, resume=resume))
        time.sleep(30)  # keep the stream open until it is cancelled
    call = stub(endpoint, tok).Attach(requests(), timeout=10)
    try:
        return next(call)
    finally:
        call.cancel()


def test_a_live_session_is_taken_over_only_with_its_own_secret(victim_holds):
    """Round 2, low row: with the victim's token (leaked to another process) and its pid (public on the host), a
    Hello displaced the victim's live session. Now only the secret the orchestrator gave that session on its
    "attached" message (which only the victim's process saw) takes it over: a reconnect of the same process."""
    endpoint, engine, victim, grant = victim_holds
    pid = os.getpid()  # the victim's own pid
    refused(lambda: _attach(endpoint, token("victim"), "victim", pid), grpc.StatusCode.ALREADY_EXISTS)
    refused(lambda: _first_reply(endpoint, token("victim"), "victim", pid, "0" * 32), grpc.StatusCode.ALREADY_EXISTS)
    details = refused(lambda: _first_reply(endpoint, token("victim"), "victim", pid, "not-a-secret"),
                      grpc.StatusCode.INVALID_ARGUMENT)
    assert "32 hex digits" in details
    time.sleep(0.5)
    live = engine._live_sessions(("g", "victim"))
    assert len(live) == 1 and live[0].resume == victim._resume  # the victim's own session, untouched
    unchanged(engine, grant)
    # the process that holds the secret reconnects: its new session takes the old one over
    first = _first_reply(endpoint, token("victim"), "victim", pid, victim._resume)
    assert first.command_id == "attached" and len(first.resume) == 32 and first.resume != victim._resume


def test_row7_negative_footprints_are_refused(served):
    endpoint, engine = served
    bad = pb.TurnRequest(job_id="mallory", group_id="g", footprint_bytes=-5)
    refused(lambda: stub(endpoint, token("mallory")).Acquire(bad, timeout=5), grpc.StatusCode.INVALID_ARGUMENT)
    hb = pb.TenantMessage(heartbeat=pb.Heartbeat(footprint_bytes=-5))
    try:
        _attach(endpoint, token("mallory"), "mallory", os.getpid(), [hb])
    except grpc.RpcError:
        pass  # the session of the job that sent it ends; no other job is touched
    rec = engine.groups.get("g") and engine.groups["g"].tenants.get("mallory")
    assert rec is None or rec.footprint_bytes >= 0


@pytest.mark.parametrize("memory", [pb.Memory(residue_bytes=-5), pb.Memory(host_bytes=1 << 62)])
def test_row7_a_results_memory_is_bounded_as_a_heartbeats(served, memory):
    """A park's result carries the memory it left (CommandResult.memory): a negative or absurd count ends the
    sender's session and is never recorded, as in a heartbeat."""
    endpoint, engine = served
    hb = pb.TenantMessage(heartbeat=pb.Heartbeat(footprint_bytes=1000, host_bytes=7, residue_bytes=7))
    bad = pb.TenantMessage(result=pb.CommandResult(command_id="x", ok=True, memory=memory))
    try:
        _attach(endpoint, token("mallory"), "mallory", os.getpid(), [hb, bad, hb])
    except grpc.RpcError:
        pass  # the session of the job that sent it ends; no other job is touched
    rec = engine.groups["g"].tenants["mallory"]
    assert (rec.host_bytes, rec.residue_bytes) == (7, 7)  # the first heartbeat's: nothing after the bad result
    assert not engine._live_sessions(("g", "mallory"))


@pytest.mark.parametrize("field,value", [("priority", 2**31 - 1), ("priority", -(2**31)), ("weight", math.nan),
                                         ("weight", math.inf), ("weight", -1.0)])
def test_row8_priority_and_weight_are_bounded_and_finite(served, field, value):
    endpoint, engine = served
    req = pb.TurnRequest(job_id="mallory", group_id="g", **{field: value})
    details = refused(lambda: stub(endpoint, token("mallory")).Acquire(req, timeout=5),
                      grpc.StatusCode.INVALID_ARGUMENT)
    assert field in details
    assert "g" not in engine.groups or engine.groups["g"].queued("mallory") is None


def test_row9_a_grant_whose_acquire_ended_goes_to_the_next_waiter(served):
    """v1alpha1 waiters whose deadline runs out just as the holder releases: none may keep the group."""
    endpoint, engine = served
    assert OrchestratorConfig().v1_max_turn_s > 0  # and sessionless holders have a turn limit by default
    holder = stub(endpoint, token("holder"))
    stuck = 0
    for i in range(40):
        job = f"w{i}"
        grant = holder.Acquire(pb.TurnRequest(job_id="holder", group_id="g"), timeout=5)
        waiter = v1alpha1(endpoint, token(job))
        timer = threading.Timer(0.2, lambda t=grant.token: holder.Release(
            pb.ReleaseRequest(job_id="holder", group_id="g", token=t), timeout=5))
        timer.start()
        try:
            waiter.Acquire(v1a.AcquireRequest(job_id=job, group_id="g"), timeout=0.2 + (i % 5) * 0.001)
            waiter.Yield(v1a.YieldRequest(job_id=job, group_id="g"), timeout=5)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            deadline = time.monotonic() + 2
            while engine.groups["g"].holder == job and time.monotonic() < deadline:
                time.sleep(0.01)
            stuck += engine.groups["g"].holder == job
        timer.join()
    assert stuck == 0


def test_row10_idle_groups_are_collected_and_status_is_paged(served):
    endpoint, engine = served
    admin = stub(endpoint, token(admin=True))
    grants = [admin.Acquire(pb.TurnRequest(job_id="j", group_id=f"grp{i:04d}"), timeout=5) for i in range(700)]
    first = admin.Status(pb.StatusRequest(), timeout=5)  # every group held: none is idle yet
    assert len(first.groups) == 500 and first.next_page_token  # bounded, the rest on the next page
    rest = admin.Status(pb.StatusRequest(page_token=first.next_page_token), timeout=5)
    assert len(rest.groups) == 200 and not rest.next_page_token
    for i, g in enumerate(grants):
        admin.Release(pb.ReleaseRequest(job_id="j", group_id=f"grp{i:04d}", token=g.token), timeout=5)
    deadline = time.monotonic() + 10
    while engine.groups and time.monotonic() < deadline:  # idle for idle_group_ttl_s (1 s): forgotten
        time.sleep(0.2)
    assert not engine.groups


@pytest.mark.parametrize("job", ["victim\n", "victim\nFAKE ROW", "x" * 129, "x" * (1 << 20)])
def test_row11_ids_are_matched_whole_and_bounded(served, job):
    endpoint, engine = served
    req = pb.TurnRequest(job_id=job, group_id="g")
    details = refused(lambda: stub(endpoint, token(admin=True)).Acquire(req, timeout=5),
                      grpc.StatusCode.INVALID_ARGUMENT)
    assert len(details) < 400  # the id is not echoed back whole
    assert "g" not in engine.groups


def test_row12_huge_reasons_and_invalid_utf8_are_invalid_arguments(victim_holds, caplog):
    endpoint, engine, _, grant = victim_holds
    admin = stub(endpoint, token(admin=True))
    huge = pb.EvictRequest(job_id="victim", group_id="g", reason="x\nFAKE LOG LINE\n" * (1 << 18))
    refused(lambda: admin.Evict(huge, timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    unchanged(engine, grant)
    raw = pb.EvictRequest(job_id="vict", group_id="g").SerializeToString().replace(b"vict", b"v\xff\xfet")
    call = auth.channel(endpoint, token=token(admin=True)).unary_unary(
        "/rota.v1.RotaService/Evict", request_serializer=lambda b: b, response_deserializer=pb.EvictReply.FromString)
    refused(lambda: call(raw, timeout=5), grpc.StatusCode.INVALID_ARGUMENT)
    short = pb.EvictRequest(job_id="victim", group_id="g", reason="done\nFAKE ROW\x1b[31m")
    with caplog.at_level("INFO"):
        admin.Evict(short, timeout=5)
    assert not any("\nFAKE ROW" in r.getMessage() or "\x1b" in r.getMessage() for r in caplog.records)


@pytest.fixture
def shared_tmp():
    """A folder like /tmp itself (sticky, everyone may create in it): where the attack happens."""
    path = pathlib.Path(tempfile.mkdtemp(dir="/tmp", prefix="rota-sec-"))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_row24_embedded_orchestrator_refuses_a_folder_another_user_prepared(shared_tmp, as_attacker):
    """Another uid pre-creates the runtime folder (0777) with a symlinked lock: the victim refuses to use it."""
    folder = shared_tmp / "rota-runtime"
    target = shared_tmp / "precious"
    target.write_text("keep me")
    made = as_attacker(f"import os; os.mkdir({str(folder)!r}); os.chmod({str(folder)!r}, 0o777); "
                       f"os.symlink({str(target)!r}, {str(folder / 'orchestrator.lock')!r})")
    assert made.returncode == 0, made.stderr
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}, "ROTA_RUNTIME_DIR": str(folder)}
    victim = subprocess.run([os.sys.executable, "-c", "import rota; rota.connect(group='g', tenant='t')"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert victim.returncode != 0 and "mode 700" in victim.stderr, victim.stderr[-2000:]
    assert target.read_text() == "keep me"  # the lock's symlink was never followed
    assert not (folder / "orchestrator.sock").exists()
