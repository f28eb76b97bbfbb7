"""A stopping service says farewell: the live sessions' next heartbeats are answered 410 (session ended), which
makes the tinker SDK end its heartbeat loop, instead of the SDK warning every 10 s at a closed port forever."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker_testlib import KEYS

from rota.errors import ConfigError
from rota_tinker import DEFAULT_BASE_MODELS, ServiceConfig, Tenant, TinkerService


def _heartbeat(url: str, sid: str) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/session_heartbeat", json={"session_id": sid},
                      headers={"X-API-Key": KEYS["alice"]}, timeout=30)


def test_stop_answers_live_heartbeats_410_then_closes(tmp_path: Path) -> None:
    cfg = ServiceConfig(tenants=(Tenant("alice", KEYS["alice"]),), data_dir=str(tmp_path), farewell_s=60.0,
                        base_models=dict(DEFAULT_BASE_MODELS))
    svc = TinkerService(cfg)
    svc.start()
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"])  # the SDK makes its session
    sid, url = sc.holder.get_session_id(), svc.url
    assert _heartbeat(url, sid).status_code == 200  # live: seen just now
    stopped = threading.Event()
    threading.Thread(target=lambda: (svc.stop(), stopped.set()), daemon=True).start()
    for _ in range(600):  # until stop() says farewell (a hang guard, not a threshold)
        if svc.state.stopping:
            break
        time.sleep(0.05)
    assert not stopped.is_set(), "stop() closed without waiting for the live session's heartbeat"
    answer = _heartbeat(url, sid)
    assert answer.status_code == 410 and "stopping" in answer.json()["detail"]
    assert stopped.wait(60), "stop() kept waiting after every live session had its answer"
    with pytest.raises(httpx.ConnectError):
        _heartbeat(url, sid)


def test_farewell_is_bounded(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="farewell_s=61"):
        ServiceConfig(tenants=(Tenant("alice", KEYS["alice"]),), data_dir=str(tmp_path), farewell_s=61,
                      base_models=dict(DEFAULT_BASE_MODELS))
