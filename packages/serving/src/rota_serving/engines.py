"""What serving needs to know of the inference engines: memory tags and routes.

The engines' names and their sleep/wake protocol are core's :mod:`rota.engines` (the node
agent speaks it too); this module adds what only serving needs. Who reads it: every module of
:mod:`rota_serving`, and the adapters (rota_vllm, rota_sglang) when they check the tags a caller passes.
"""

from __future__ import annotations

from collections.abc import Sequence

from rota.engines import SGLANG, VLLM
from rota.errors import InvalidArgument

#: Tags each engine understands (vLLM ``wake_up(tags=)``, SGLang memory-saver tags).
APP_TAGS: dict[str, tuple[str, ...]] = {VLLM: ("weights", "kv_cache"), SGLANG: ("weights", "kv_cache", "cuda_graph")}
#: Engine routes that move memory: only rota may call them, so the proxy refuses them.
CONTROL_PATHS = frozenset({"/sleep", "/wake_up", "/release_kv_cache_memory", "/release_memory_occupation",
                           "/resume_memory_occupation"})
#: Routes that never need the GPU: forwarded without taking a turn.
FREE_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/v1/models", "/is_sleeping",
                        "/get_model_info", "/get_server_info", "/health_generate_skip"})


def check_app(app: str) -> str:
    """``app`` if it is an engine rota serves; the message lists them otherwise."""
    if app not in APP_TAGS:
        raise InvalidArgument(f"app {app!r} is not one of {', '.join(APP_TAGS)}")
    return app


def check_tags(app: str, tags: Sequence[str], what: str = "tags") -> tuple[str, ...]:
    """Each tag must be one ``app`` knows; the message lists the ones it does."""
    known = APP_TAGS[check_app(app)]
    for t in tags:
        if t not in known:
            raise InvalidArgument(f"{what}: {t!r} is not a {app} memory tag; use one of {', '.join(known)}")
    return tuple(tags)


__all__ = ["APP_TAGS", "CONTROL_PATHS", "FREE_PATHS", "SGLANG", "VLLM", "check_app", "check_tags"]
