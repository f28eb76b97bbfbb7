"""Test helpers of rota_serving and the adapters built on it: fake engines, JSON over HTTP.

The fakes are real HTTP servers on loopback that keep the state the engine would keep
(:mod:`rota_serving.testing.fake_vllm`, :mod:`rota_serving.testing.fake_sglang`);
:func:`fake_engine_command` runs one (``python -m rota_serving.testing``) as the engine of ``serve_app``.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

from rota_serving.engines import check_app
from rota_serving.testing.fake_server import FakeEngineServer
from rota_serving.testing.fake_sglang import FakeSglangServer
from rota_serving.testing.fake_vllm import FakeVllmServer


def fake_engine_command(app: str, port: int) -> list[str]:
    """The command line of a fake ``app`` engine serving ``127.0.0.1:port`` (for ``ServeConfig.command``)."""
    return [sys.executable, "-m", "rota_serving.testing", check_app(app), "--port", str(port)]


def post_json(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
    """``POST`` ``body`` as JSON; (status, parsed answer), also for an HTTP error status."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get_json(url: str, timeout: float = 10) -> Any:
    """``GET`` ``url``; the parsed JSON answer (the fakes' ``/fake/calls``)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


__all__ = ["FakeEngineServer", "FakeSglangServer", "FakeVllmServer", "fake_engine_command", "get_json", "post_json"]
