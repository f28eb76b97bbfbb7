"""rota_serving: inference servers (vLLM, SGLang) served as rota tenants over HTTP.

Shared by rota_vllm and rota_sglang, which add each engine's command line and version
check. ``serve_app`` starts the engine on an internal port, joins rota as a tenant and
serves a proxy in front of it: a request that arrives while the engine is parked
waits for the engine's turn and then runs; the turn is given back when requests stop::

    served = rota_serving.serve_app(rota_serving.ServeConfig(
        app="vllm", command=[...], engine_port=port, listen="0.0.0.0:8000"))
    served.wait()

Modules, one job each: :mod:`~rota_serving.engines` (what each engine is),
:mod:`~rota_serving.endpoint` (its HTTP API), :mod:`~rota_serving.parker` (park
hooks), :mod:`~rota_serving.gate` (turns on demand), :mod:`~rota_serving.proxy`,
:mod:`~rota_serving.supervisor` (``serve_app``), :mod:`~rota_serving.cli` (the
``serve`` command), :mod:`~rota_serving.hookspecs` (registration with a node agent),
:mod:`~rota_serving.testing` (fake engines for tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time each loads on first use (``rota --help``
    # loads the vLLM and SGLang plugins, which need only ``make_serve`` and ``EngineVersions``)
    from rota_serving.cli import make_serve
    from rota_serving.endpoint import EndpointClient, EngineVersions, ServingError, check_base_url, check_server_version
    from rota_serving.engines import APP_TAGS, CONTROL_PATHS, FREE_PATHS, SGLANG, VLLM, check_app, check_tags
    from rota_serving.gate import TurnGate
    from rota_serving.parker import (
        EndpointParker,
        check_fixed_device,
        device_share_bytes,
        release_idle_cache,
        track_endpoint,
        wait_attached,
    )
    from rota_serving.proxy import TurnProxy
    from rota_serving.supervisor import ServeConfig, Served, check_listen, register_with_agent, serve_app, stop_process

__all__ = ["APP_TAGS", "CONTROL_PATHS", "FREE_PATHS", "SGLANG", "VLLM", "EndpointClient", "EndpointParker",
           "EngineVersions", "ServeConfig", "Served", "ServingError", "TurnGate", "TurnProxy", "check_app",
           "check_base_url", "check_fixed_device", "check_listen", "check_server_version", "check_tags",
           "device_share_bytes", "make_serve", "register_with_agent", "release_idle_cache", "serve_app",
           "stop_process", "track_endpoint", "wait_attached"]

_HOME = {name: module for module, names in (
    ("rota_serving.cli", ["make_serve"]),
    ("rota_serving.endpoint", ["EndpointClient", "EngineVersions", "ServingError", "check_base_url",
                               "check_server_version"]),
    ("rota_serving.engines", ["APP_TAGS", "CONTROL_PATHS", "FREE_PATHS", "SGLANG", "VLLM", "check_app", "check_tags"]),
    ("rota_serving.gate", ["TurnGate"]),
    ("rota_serving.parker", ["EndpointParker", "check_fixed_device", "device_share_bytes", "release_idle_cache",
                              "track_endpoint", "wait_attached"]),
    ("rota_serving.proxy", ["TurnProxy"]),
    ("rota_serving.supervisor", ["ServeConfig", "Served", "check_listen", "register_with_agent", "serve_app",
                                 "stop_process"]),
) for name in names}
__getattr__ = lazy_getattr(__name__, _HOME)
