"""Issue 30, item 4: a bounded, authenticated Tinker front end.

The attacker had: one unauthenticated client holding ~2,100 sockets got every tenant 503 (the
connection cap was global); no TLS, and no warning on a listener beyond loopback; wrong keys
neither logged nor slowed (6,000 guesses/s). Here ``rota serve tinker`` runs as users run it,
the attacker uses raw sockets from other loopback addresses (127.0.0.2, ...), and the tenant
the real HTTP client with its key; each test checks the tenant is still served.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("tinker")
from rota_tinker.testing import serving_process
from tests.security.test_tls import pki  # noqa: F401  (fixture: a test CA and a certificate for 127.0.0.1)

KEY = "tml-dkOel_dHA9wmADNIS1qB0EFXgoZ3n-Q7CKltipvKKGU"
MAX_CONNECTIONS, PER_CLIENT, UNAUTHENTICATED = 200, 50, 60


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROTA_", "TINKER_"))}
    env["TINKER_TELEMETRY"] = "0"
    return env


@contextlib.contextmanager
def _served(tmp_path, *extra: str) -> Iterator[tuple[str, list[str]]]:
    args = ["--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--tenant", f"alice={KEY}",
            "--header-timeout", "60", "--max-connections", str(MAX_CONNECTIONS), "--max-client-connections",
            str(PER_CLIENT), "--max-unauthenticated", str(UNAUTHENTICATED), *extra]
    with serving_process(args, _env()) as (_, head, lines):
        yield re.search(r"serving (https?://\S+) ", head).group(1), lines


def _half_sent(port: int, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nContent-Ty")  # and never the rest
    return s


def _open(s: socket.socket) -> bool:
    s.settimeout(0.2)
    try:
        return s.recv(1) != b""
    except TimeoutError:
        return True
    except OSError:
        return False


def _tenant_served(url: str) -> int:
    return httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}, timeout=10).status_code


def test_slow_keyless_clients_cannot_keep_a_tenant_out(tmp_path):
    with _served(tmp_path) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        socks: list[socket.socket] = []
        try:
            socks += [_half_sent(port, "127.0.0.2") for _ in range(2 * PER_CLIENT)]
            time.sleep(0.3)
            assert sum(_open(s) for s in socks) == PER_CLIENT  # one peer: its cap, the rest closed at once
            assert _tenant_served(url) == 200
            for i in range(3, 3 + MAX_CONNECTIONS // PER_CLIENT + 2):  # from many peers: more than the global cap
                socks += [_half_sent(port, f"127.0.0.{i}") for _ in range(PER_CLIENT)]
            time.sleep(0.3)
            assert sum(_open(s) for s in socks) <= UNAUTHENTICATED  # the oldest keyless ones were closed
            with httpx.Client(headers={"X-API-Key": KEY}, timeout=10) as tenant:
                assert tenant.get(f"{url}/api/v1/get_server_capabilities").status_code == 200
                socks += [_half_sent(port, "127.0.0.99") for _ in range(PER_CLIENT)]  # the flood goes on
                assert tenant.get(f"{url}/api/v1/get_server_capabilities").status_code == 200  # kept its place
        finally:
            for s in socks:
                s.close()


MALLORY = "tml-6Wm0yQ2rJt8vVbN4xKc1sPz7dHf3gLe9aUo5iRqTjYw"  # the attacker's own, valid key
PER_KEY = 40


def _held_upload(port: int, source: str) -> socket.socket:
    """A whole request head with the attacker's valid key, announcing a body that never comes."""
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"X-API-Key: " + MALLORY.encode() + b"\r\nContent-Length: 1000000\r\n\r\n")
    return s


def test_a_tenant_holding_bodiless_requests_keeps_only_itself_out(tmp_path):
    """Issue 45 row 9: with its valid key, from many loopback addresses, the attacker held 2,100 POSTs declaring
    a 1 MB body and sending none; every other tenant got 503 for as long as it went on (a keyed connection was
    never evicted and the body deadline is 60 s). Now one key holds at most --max-key-connections."""
    with _served(tmp_path, "--tenant", f"mallory={MALLORY}", "--max-key-connections", str(PER_KEY)) as (url, lines):
        port = int(url.rsplit(":", 1)[1])
        socks: list[socket.socket] = []
        try:
            for i in range(2, 2 + 2 * MAX_CONNECTIONS // PER_CLIENT):  # twice the global cap, under each peer's
                socks += [_held_upload(port, f"127.0.1.{i}") for _ in range(PER_CLIENT - 5)]
            time.sleep(1.0)
            assert sum(_open(s) for s in socks) <= PER_KEY  # the rest were closed once their heads arrived
            with httpx.Client(headers={"X-API-Key": KEY}, timeout=10) as tenant:
                for _ in range(5):
                    assert tenant.get(f"{url}/api/v1/get_server_capabilities").status_code == 200
                    socks += [_held_upload(port, "127.0.1.250") for _ in range(10)]  # the flood goes on
            log = "".join(lines)
            assert "--max-key-connections" in log and MALLORY not in log  # logged, never the key
        finally:
            for s in socks:
                s.close()


def test_wrong_keys_are_logged_and_slowed(tmp_path):
    with _served(tmp_path) as (url, lines):
        guesses = [f"tml-guess-{i:08d}" for i in range(8)]
        t0 = time.monotonic()
        for guess in guesses:
            r = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": guess}, timeout=30)
            assert r.status_code == 401 and guess not in r.text
        waited = time.monotonic() - t0
        assert waited >= 0.05 * (2 ** 8 - 1) * 0.9, waited  # each refusal waited twice the one before
        log = "".join(lines)
        assert log.count("unknown API key from 127.0.0.1") >= 8 and not any(g in log for g in guesses)
        assert _tenant_served(url) == 200


def test_tls_and_the_warning_beyond_loopback(tmp_path, pki):  # noqa: F811
    with _served(tmp_path, "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")) as (url, _):
        assert url.startswith("https://")
        r = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}, timeout=10,
                      verify=ssl.create_default_context(cafile=str(pki / "ca.pem")))
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP gets no answer
            httpx.get(url.replace("https://", "http://") + "/api/v1/healthz", timeout=5)
    args = ["--listen", "0.0.0.0:0", "--data-dir", str(tmp_path / "d2"), "--tenant", f"alice={KEY}"]
    with serving_process(args, _env()) as (_, _head, lines):
        assert any("WARNING: serving plain HTTP on 0.0.0.0" in line for line in lines), lines
    out = subprocess.run([sys.executable, "-m", "rota", "serve", "tinker", "--tls-cert", str(pki / "server.pem"),
                          "--tenant", f"a={KEY}"], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--tls-key" in out.stderr
