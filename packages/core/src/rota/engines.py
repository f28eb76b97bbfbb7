"""The sleep/wake HTTP protocol of the inference engines rota parks, described once (no HTTP client here).

Who reads it: rota_serving's ``EndpointClient`` (inside a served engine's own process)
and the node agent's ``app_endpoint`` backend (for remote callers); each sends these
requests with its own HTTP caller, bounds and error messages.

* vLLM (``--enable-sleep-mode``, ``VLLM_SERVER_DEV_MODE=1``): ``POST /sleep?level=1`` offloads
  weights to host and drops the KV cache, ``level=2`` drops both (DISCARD);
  ``POST /wake_up[?tags=...]`` brings them back; ``GET /is_sleeping`` (``{"is_sleeping":
  bool}``) is checked after a sleep and after a full wake (a partial wake reports sleep
  until every tag is back).
* SGLang (``--enable-memory-saver``): ``POST /release_memory_occupation`` and
  ``POST /resume_memory_occupation`` with ``{"tags": [...]}`` (``{}`` = everything).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rota._types import ParkMode

VLLM, SGLANG = "vllm", "sglang"
IS_SLEEPING = "/is_sleeping"  # vLLM's state route (GET)

__all__ = ["IS_SLEEPING", "SGLANG", "VLLM", "Step", "sleep_step", "sleeping_mismatch", "wake_step"]


@dataclass(frozen=True)
class Step:
    """One sleep or wake of one engine: ``method path`` with the JSON ``body`` (None: an empty POST),
    then, unless ``expect_sleeping`` is None, ``GET /is_sleeping`` must report it."""

    method: str
    path: str
    body: dict[str, Any] | None
    expect_sleeping: bool | None


def sleep_step(app: str, mode: ParkMode = ParkMode.OFFLOAD, tags: Sequence[str] = ()) -> Step:
    """Park ``app`` (vLLM: level 1 for OFFLOAD, 2 for DISCARD; SGLang: release ``tags``, all when empty)."""
    if app == SGLANG:
        return Step("POST", "/release_memory_occupation", {"tags": list(tags)} if tags else {}, None)
    return Step("POST", f"/sleep?level={2 if mode == ParkMode.DISCARD else 1}", None, True)


def wake_step(app: str, tags: Sequence[str] = ()) -> Step:
    """Bring back ``tags`` of ``app`` (all when empty)."""
    if app == SGLANG:
        return Step("POST", "/resume_memory_occupation", {"tags": list(tags)} if tags else {}, None)
    query = urllib.parse.urlencode([("tags", t) for t in tags])
    return Step("POST", "/wake_up" + (f"?{query}" if query else ""), None, None if tags else False)


def sleeping_mismatch(answer: Any, expected: bool) -> str:
    """"" when the ``GET /is_sleeping`` ``answer`` reports ``expected``; else what it reports instead
    (``is_sleeping=False``, or that it is no boolean: nothing else of the answer is repeated)."""
    sleeping = answer.get("is_sleeping") if isinstance(answer, dict) else None
    if sleeping is expected:
        return ""
    return f"is_sleeping={sleeping!r}" if isinstance(sleeping, (bool, type(None))) \
        else "an is_sleeping that is not a boolean"
