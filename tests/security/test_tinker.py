"""Rows 17-21: the Tinker service against callers that do not play by its rules.

The service runs as users run it: ``python -m rota serve tinker`` in its own process,
serving HTTP on loopback, its tenants' workers real processes, its orchestrator its own.
Attackers use raw sockets, plain HTTP (httpx) or the official tinker SDK, and a second
local uid (``as_attacker``) where the row is about local users. Each test shows the
attack fails and that what the service holds did not change.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import resource
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from rota.admin import fetch_status  # noqa: E402
from rota_tinker import ServiceConfig, Tenant, TinkerService  # noqa: E402
from rota_tinker.testing import serving_process  # noqa: E402

KEYS = {  # 128 random bits and more: the service refuses guessable keys
    "alice": "tml-JkyyOZ6ouV7EgPPRxzpHgiRF2br0YLm_VlRXCEla9lI",
    "bob": "tml-JJpEV26aiFKB13RrTrH9wrzBZq65R0m5prf4sI-kQDI",
    "carol": "tml-8fBWwSXEltm1L5Wjsc3wOYeGC00Z4FjzdgpW8I4riqA",
}
MIB = 1 << 20
HEADER_TIMEOUT_S = 8.0
MAX_CONNECTIONS = 1600
TIMEOUT = 120
MAX_REQUEST_TOKENS = 600


@dataclass
class Served:
    """A ``rota serve tinker`` process: its pid, URL, orchestrator endpoint, data dir and stderr lines."""

    proc: subprocess.Popen
    url: str
    endpoint: str
    data_dir: Path
    log: list[str] = field(default_factory=list)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def status(self, name: str) -> int:
        """A number from /proc/PID/status (VmRSS, VmHWM in kB; Threads)."""
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(rf"^{name}:\s+(\d+)", text, re.M).group(1))

    def post(self, route: str, key: str | None, body: object, **kw: object) -> httpx.Response:
        headers = {"X-API-Key": key} if key else {}
        return httpx.post(f"{self.url}/api/v1/{route}", json=body, headers=headers, timeout=30, **kw)

    def result(self, key: str, request_id: str) -> dict:
        """Long-poll a future until it is done; its JSON result (or error)."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            r = self.post("retrieve_future", key, {"request_id": request_id})
            assert r.status_code == 200, r.text
            if r.json().get("type") != "try_again":
                return r.json()
        raise AssertionError(f"{request_id} did not finish within {TIMEOUT} s")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The service as `rota serve tinker` runs it, with small limits so an attacker reaches them quickly."""
    data = tmp_path_factory.mktemp("tinker-sec") / "data"
    args = ["--listen", "127.0.0.1:0", "--data-dir", str(data),
            *(a for name, key in KEYS.items() for a in ("--tenant", f"{name}={key}")), "--long-poll", "2",
            "--capacity", "1GiB", "--header-timeout", str(HEADER_TIMEOUT_S), "--max-connections",
            str(MAX_CONNECTIONS), "--max-client-connections", str(2 * MAX_CONNECTIONS), "--max-models", "2",
            "--max-sessions", "3", "--max-bytes", "20MB", "--max-request-tokens", str(MAX_REQUEST_TOKENS)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROTA_", "TINKER_"))}
    env["TINKER_TELEMETRY"] = "0"
    with serving_process(args, env) as (proc, head, lines):
        url = re.search(r"serving (http://\S+) ", head).group(1)
        endpoint = re.search(r"own orchestrator (unix:[^\s,]+)", head).group(1)
        yield Served(proc, url, endpoint, data, lines)


def healthz(served: Served, timeout: float = 2.0) -> int:
    return httpx.get(f"{served.url}/api/v1/healthz", timeout=timeout).status_code


def read_reply(sock: socket.socket, timeout: float = 10.0) -> tuple[int, bytes]:
    """Read one HTTP response from ``sock``: (status, body)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split()[1]), body


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True when the server closes ``sock`` within ``timeout`` seconds."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# ------------------------------------------------------------------ row 17


def test_row17_unauthenticated_upload_is_refused_before_its_body(served: Served) -> None:
    """8 parallel 64 MiB uploads without a (valid) key: 401 from the headers alone, the body never read."""
    host, port = served.address
    hwm0 = served.status("VmHWM")

    def upload(i: int) -> tuple[int, str, int]:
        key = f"X-API-Key: tml-wrong-key-{i:08d}\r\n" if i % 2 else ""
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(f"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                      f"Content-Length: {64 * MIB}\r\n{key}\r\n".encode())
            status, body = read_reply(s)  # answered before a byte of the body was sent
            sent, chunk = 0, b"\0" * MIB
            with contextlib.suppress(OSError):
                while sent < 64 * MIB:
                    sent += s.send(chunk)
            return status, json.loads(body)["detail"], sent

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(upload, range(8)))
    for status, detail, sent in results:
        assert status == 401 and ("X-API-Key" in detail or "not known" in detail), detail
        assert sent < 16 * MIB  # the server closed the connection: the rest of the upload had nowhere to go
    assert (served.status("VmHWM") - hwm0) * 1024 < 32 * MIB  # it did not buffer 8 x 64 MiB (before: +325 MB)
    # with a valid key, a body over the route's limit is refused from its Content-Length alone
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"X-API-Key: {KEYS['bob']}\r\nContent-Length: {64 * MIB}\r\n\r\n".encode())
        status, body = read_reply(s)
    assert status == 413 and "limit" in json.loads(body)["detail"]
    assert healthz(served) == 200
    assert sorted(p.name for p in served.data_dir.iterdir()) == sorted(KEYS)  # nothing written
    assert all(not any((served.data_dir / t).iterdir()) for t in KEYS)


# ------------------------------------------------------------------ row 18


def test_row18_half_sent_requests_hold_no_thread_and_are_cut(served: Served) -> None:
    """1,500 half-sent requests: /healthz answers at once, no thread per socket, all cut at the head deadline
    (the oldest at once: at most half of --max-connections may wait without a key; test_tinker_gate.py)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this test holds MAX_CONNECTIONS sockets
    if soft < MAX_CONNECTIONS + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, MAX_CONNECTIONS + 256), hard))
    assert healthz(served) == 200
    threads0 = served.status("Threads")
    host, port = served.address
    socks: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        for _ in range(1500):
            s = socket.create_connection((host, port), timeout=10)
            s.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nContent-Ty")  # and never the rest
            socks.append(s)
        dribbler = socket.create_connection((host, port), timeout=10)
        socks.append(dribbler)
        t = time.monotonic()
        assert healthz(served) == 200 and time.monotonic() - t < 1.0
        assert served.status("Threads") <= threads0 + 2  # the sockets hold no threads
        assert all(closed_by_peer(s, 1.0) for s in socks[:1501 - MAX_CONNECTIONS // 2])
        for ch in b"GET /api/v1/healthz HTTP/1.1\r\nHost":  # a byte at a time does not extend the deadline
            dribbler.send(bytes([ch]))
            if time.monotonic() - t0 > HEADER_TIMEOUT_S - 1:
                break
            time.sleep(0.2)
        assert all(closed_by_peer(s, max(0.1, t0 + HEADER_TIMEOUT_S + 5 - time.monotonic())) for s in socks)
    finally:
        for s in socks:
            s.close()
    assert healthz(served) == 200
    assert served.status("Threads") <= threads0 + 2


# ------------------------------------------------------------------ row 19


def test_row19_numbers_out_of_range_are_400_and_change_nothing(served: Served) -> None:
    """NaN/-0.5/127.9 target tokens, ids of 2**62 and 2**70, NaN and 1e999 in JSON, 100k-deep JSON: 400 each."""
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEYS["carol"])
    tc = sc.create_lora_training_client(base_model="rota/tiny", rank=2, seed=5).result(timeout=TIMEOUT)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 128, size=9)
    good = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1].tolist()),
                       loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(toks[1:].astype(np.int64))})

    def loss() -> float:
        return tc.forward([good], "cross_entropy").result(timeout=TIMEOUT).metrics["loss:sum"]

    before = loss()
    inputs = [[1, 2, 3]]
    for target, dtype in (([float("nan"), -0.5, 127.9], "float32"), ([1, 2**62, 3], "int64"),
                          ([1.0, float("inf"), 3.0], "float32")):
        bad = types.Datum(model_input=types.ModelInput.from_ints(inputs[0]),
                          loss_fn_inputs={"target_tokens": types.TensorData(data=target, dtype=dtype, shape=[3])})
        with pytest.raises(tinker.BadRequestError, match="target_tokens"):
            tc.forward_backward([bad], "cross_entropy").result(timeout=TIMEOUT)
    nan_weights = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
        "target_tokens": types.TensorData(data=[1, 2, 3], dtype="int64", shape=[3]),
        "weights": types.TensorData(data=[1.0, float("nan"), 1.0], dtype="float32", shape=[3])})
    with pytest.raises(tinker.BadRequestError, match="weights"):
        tc.forward_backward([nan_weights], "cross_entropy").result(timeout=TIMEOUT)
    key = KEYS["carol"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2**70]}]}
    r = served.post("asample", key, {"base_model": "rota/tiny", "prompt": prompt, "sampling_params": {}})
    assert r.status_code == 400 and "prompt.chunks[0].tokens[1]" in r.json()["detail"], r.text
    prompt["chunks"][0]["tokens"] = [1, 2]
    r = served.post("asample", key, {"base_model": "rota/tiny", "prompt": prompt, "sampling_params": {"seed": 2**70}})
    assert r.status_code == 400 and "'seed'" in r.json()["detail"], r.text
    for number in ("NaN", "Infinity", "1e999"):
        text = f'{{"model_id": "{tc.model_id}", "adam_params": {{"learning_rate": {number}}}}}'
        r = httpx.post(f"{served.url}/api/v1/optim_step", content=text, timeout=30,
                       headers={"X-API-Key": key, "Content-Type": "application/json"})
        assert r.status_code == 400 and "finite" in r.json()["detail"], (number, r.text)
    deep = '{"session_id": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = httpx.post(f"{served.url}/api/v1/create_session", content=deep, timeout=30,
                   headers={"X-API-Key": key, "Content-Type": "application/json"})
    assert r.status_code == 400 and "nests deeper" in r.json()["detail"], r.text
    assert loss() == before  # the model is what it was: no attack reached it


def test_row19_one_huge_training_request_is_refused_and_the_sdk_splits_below_the_cap(served: Served) -> None:
    """A forward_backward of more tokens than --max-request-tokens would hold the device for its whole turn:
    sent raw in one request it is 400 naming the cap; the SDK, told the cap by the client config, splits the
    same batch into requests under it and trains on all of it."""
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEYS["carol"])
    tc = sc.create_lora_training_client(base_model="rota/tiny", rank=2, seed=7).result(timeout=TIMEOUT)
    rng = np.random.default_rng(1)
    batch = []
    for _ in range(4):  # 4 x 200 = 800 tokens > 600
        toks = rng.integers(0, 128, size=201)
        batch.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1].tolist()), loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(toks[1:].astype(np.int64))}))
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=batch, loss_fn="cross_entropy"),
        model_id=tc.model_id, seq_id=1)
    body = forward_backward_request_to_proto(request).SerializeToString()
    r = httpx.post(f"{served.url}/api/v1/forward_backward", content=body, timeout=30,
                   headers={"X-API-Key": KEYS["carol"], "Content-Type": "application/x-protobuf"})
    assert r.status_code == 400, r.text
    assert "800 tokens" in r.json()["detail"] and "--max-request-tokens" in r.json()["detail"], r.text

    out = tc.forward_backward(batch, "cross_entropy").result(timeout=TIMEOUT)
    assert len(out.loss_fn_outputs) == 4  # every datum trained on, in requests of at most 600 tokens
    assert np.isfinite(out.metrics["loss:sum"])


# ------------------------------------------------------------------ row 20


def test_row20_quotas_per_key_and_freeing(served: Served) -> None:
    """One key may not hold more than its models, sessions and bytes (429); unloading and finishing free them."""
    key = KEYS["alice"]
    sessions = []
    for _ in range(3):
        r = served.post("create_session", key, {"tags": [], "sdk_version": "x"})
        assert r.status_code == 200, r.text
        sessions.append(r.json()["session_id"])
    r = served.post("create_session", key, {"tags": [], "sdk_version": "x"})
    assert r.status_code == 429 and "max_sessions=3" in r.json()["detail"]
    assert r.headers["x-should-retry"] == "false"  # the SDK does not retry a quota

    def create(session: str, base: str = "rota/tiny") -> httpx.Response:
        return served.post("create_model", key, {"session_id": session, "model_seq_id": 0, "base_model": base})

    def refused(r: httpx.Response) -> str:
        """A create_model over a quota: a future that failed at once (the SDK would retry a 429 for 5 min)."""
        assert r.status_code == 200, r.text
        done = served.result(key, r.json()["request_id"])
        assert done["category"] == "user" and done["error"].startswith("429 Too Many Requests"), done
        return done["error"]

    r = create(sessions[0], "rota/small")  # full-parameter rota/small: about 60 MB of weights, grads and Adam state
    assert "max_bytes=20000000" in refused(r)
    models = []
    for s in sessions[:2]:
        r = create(s)
        assert r.status_code == 200, r.text
        assert served.result(key, r.json()["request_id"]).get("type") == "create_model"
        models.append(r.json()["model_id"])
    assert "max_models=2" in refused(create(sessions[2]))
    # another key is not affected by alice's quota
    other = served.post("create_session", KEYS["bob"], {"tags": [], "sdk_version": "x"})
    assert other.status_code == 200
    # freeing: unload_model frees a model slot; finishing a session frees the session and unloads its models
    r = served.post("unload_model", key, {"model_id": models[0], "type": "unload_model"})
    assert r.status_code == 200 and served.result(key, r.json()["request_id"])["type"] == "unload_model"
    assert served.post("get_info", key, {"model_id": models[0]}).status_code == 404
    r = create(sessions[2])
    assert r.status_code == 200 and served.result(key, r.json()["request_id"]).get("type") == "create_model"
    r = httpx.post(f"{served.url}/api/v1/sessions/{sessions[1]}/finish", headers={"X-API-Key": key}, timeout=30)
    assert r.status_code == 200
    assert served.post("get_info", key, {"model_id": models[1]}).status_code == 404
    r = served.post("session_heartbeat", key, {"session_id": sessions[1]})
    assert r.status_code == 410
    assert served.post("create_session", key, {"tags": [], "sdk_version": "x"}).status_code == 200
    r = create(sessions[0])
    assert r.status_code == 200 and served.result(key, r.json()["request_id"]).get("type") == "create_model"


# ------------------------------------------------------------------ row 21


def test_row21_another_user_cannot_reach_the_services_orchestrator(served: Served, as_attacker) -> None:
    """The service's orchestrator is a Unix socket in a 0700 directory of the service's uid: another uid cannot
    reach it (let alone acquire group ``tinker``), and the service listens on no other TCP port."""
    assert served.endpoint.startswith("unix:")
    path = served.endpoint.removeprefix("unix:")
    st = os.stat(os.path.dirname(path))
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    code = f"""
import json, socket
import grpc
report = {{}}
try:
    socket.socket(socket.AF_UNIX).connect({path!r})
    report["connect"] = "done"
except OSError as exc:
    report["connect"] = type(exc).__name__
with grpc.insecure_channel({served.endpoint!r}) as ch:
    try:
        grpc.channel_ready_future(ch).result(timeout=3)
        report["grpc"] = "ready"
    except grpc.FutureTimeoutError:
        report["grpc"] = "unreachable"
print(json.dumps(report))
"""
    out = as_attacker(code)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"connect": "PermissionError", "grpc": "unreachable"}
    # the only TCP port the service process listens on is its HTTP port (before: a loopback orchestrator too)
    inodes = set()
    for fd in os.listdir(f"/proc/{served.proc.pid}/fd"):
        with contextlib.suppress(OSError):  # an fd closed meanwhile
            target = os.readlink(f"/proc/{served.proc.pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:
                listening.add(int(parts[1].rsplit(":", 1)[1], 16))
    assert listening == {served.address[1]}
    # the tenants' turns go on: bob trains through the service
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEYS["bob"])
    tc = sc.create_lora_training_client(base_model="rota/tiny", rank=2, seed=2).result(timeout=TIMEOUT)
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3, 4], dtype="int64", shape=[3])})
    assert tc.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT).metrics["loss:sum"] > 0


def test_row21_two_services_on_one_host_do_not_share_turns(tmp_path: Path) -> None:
    """Two services, same group and tenant names, no --orchestrator: each has its own orchestrator, and each
    orchestrator counts exactly its own service's turns (before: one shared embedded orchestrator, one job)."""
    tenant = Tenant("alice", KEYS["alice"])
    services = [TinkerService(ServiceConfig(tenants=(tenant,), data_dir=tempfile.mkdtemp(dir=tmp_path),
                                            long_poll_s=2.0)) for _ in range(2)]
    try:
        for svc in services:
            svc.start()
        assert services[0].endpoint != services[1].endpoint

        def train(svc: TinkerService) -> list[float]:
            sc = tinker.ServiceClient(base_url=svc.url, api_key=tenant.api_key)
            tc = sc.create_lora_training_client(base_model="rota/tiny", rank=2, seed=3).result(timeout=TIMEOUT)
            datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
                "target_tokens": types.TensorData(data=[2, 3, 4], dtype="int64", shape=[3])})
            losses = []
            for _ in range(3):
                losses.append(tc.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT).metrics["loss:sum"])
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT)
            return losses

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(train, services))
        assert runs[0] == runs[1]  # same loop, same numbers: neither service's tenant disturbed the other's
        for svc in services:
            units = [u for u in svc.unit_timings() if u["tenant"] == "alice"]
            assert units and not any(u["failed"] for u in units)
            turns = sum(int(u.get("new_turn", 0)) for u in units)
            reply = fetch_status(svc.endpoint, "tinker")
            counted = {t.job_id: t.turns for g in reply.groups for t in g.tenants}
            assert counted == {"alice.trainer": turns}  # this orchestrator saw this service's turns, and only those
    finally:
        for svc in services:
            svc.stop()
