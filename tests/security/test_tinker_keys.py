"""Issue 45, row 10: Tinker API keys could be guessed.

Keys needed only 8 characters after ``tml-`` (the README's examples were ``tml-alice-key-1``), and wrong keys were
slowed per peer address only: from 200 loopback addresses an attacker tried 100 keys a second. Now a key must
carry at least 128 random bits (a short or structured one is refused at start, naming the fix and never echoing
the key), and every failure also counts in one budget of the whole service, so many addresses are slowed together
while a known key is never slowed.

The start check runs ``rota tinker serve`` as users run it; the budget test drives the service in this process
over real HTTP from many loopback source addresses (127.0.0.2-...: Linux routes all of 127/8 to lo).
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("tinker")

from rota_tinker import BaseModelSpec, ServiceConfig, Tenant, TinkerService

WEAK = {
    "short": "tml-k7Qx9pLm2Z",  # the old rule's 8+ characters
    "structured": "tml-alice-security-0123456789-abcdef",  # the tenant's name and counters
    "words": "tml-team-production-key-2026-04-17-0001",
    "repeated": "tml-" + "a" * 40,
}
KEY = "tml-" + secrets.token_urlsafe(32)
BASE = BaseModelSpec("sec/keys", vocab=64, dim=16, layers=1, heads=2, max_len=64, seed=3)


@pytest.mark.parametrize("kind", sorted(WEAK))
def test_row10_a_guessable_key_is_refused_at_start_naming_the_fix(kind: str, tmp_path: os.PathLike) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROTA_", "TINKER_"))}
    cmd = [sys.executable, "-m", "rota", "tinker", "serve", "--listen", "127.0.0.1:0", "--data-dir",
           str(tmp_path), "--tenant", f"bob={KEY}", "--tenant", f"alice={WEAK[kind]}"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-2000:]
    assert "tenant 'alice' is guessable" in out and "128 random bits" in out and "token_urlsafe(32)" in out, out
    assert WEAK[kind] not in out and WEAK[kind][4:] not in out and KEY not in out  # no key echoed


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    config = ServiceConfig(tenants=(Tenant("alice", KEY),), data_dir=str(tmp_path_factory.mktemp("keys-sec")),
                           base_models={BASE.name: BASE})
    with TinkerService(config) as service:
        yield service


def attempt(svc: TinkerService, source: str, key: str) -> tuple[int, float]:
    """One create_session from ``source`` with ``key``: its status and seconds to the answer."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60) as client:
        t0 = time.monotonic()
        r = client.post(f"{svc.url}/api/v1/create_session", json={"tags": [], "sdk_version": "0"},
                        headers={"X-API-Key": key})
        return r.status_code, time.monotonic() - t0


def test_row10_wrong_keys_from_many_addresses_share_one_budget(svc: TinkerService) -> None:
    """40 addresses, one wrong key each (each peer's own count stays at 1: the per-peer pacing alone answered each
    in 50 ms); then a 41st address's first wrong key waits seconds, while the tenant's valid key from yet another
    address is answered at once."""
    sources = [f"127.0.0.{i}" for i in range(2, 42)]
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(lambda s: attempt(svc, s, "tml-" + secrets.token_urlsafe(32)), sources))
    assert all(status == 401 for status, _ in answers), answers
    status, waited = attempt(svc, "127.0.0.100", "tml-" + secrets.token_urlsafe(32))
    assert status == 401 and waited >= 1.5, f"a fresh address's wrong key was answered in {waited:.2f} s"
    status, waited = attempt(svc, "127.0.0.101", KEY)
    assert status == 200 and waited < 1.0, (status, waited)
