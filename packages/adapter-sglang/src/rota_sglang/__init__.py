"""rota_sglang: SGLang inference engines that take turns on GPUs with trainers, through rota.

* **In-process** (``sglang.Engine(..., enable_memory_saver=True)``)::

      gpu = rota.connect()
      tracked = rota_sglang.track(gpu, engine)     # park = release_memory_occupation
      with gpu.turn():                             # resume_memory_occupation
          tracked.update_weights(model.named_parameters())
          outs = engine.generate(prompts, params)

* **Server** (``rota sglang serve -- <sglang.launch_server args>``): the engine runs with
  ``--enable-memory-saver`` on an internal port behind rota's proxy; requests that
  arrive while it is parked wait for its turn. :class:`SglangServer` pushes weights.

Tags: ``weights``, ``kv_cache``, ``cuda_graph``. SGLang is an optional extra
(``pip install "rota-adapter-sglang[sglang]"``); the serving machinery is
:mod:`rota_serving`'s, shared with the vLLM adapter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time each loads on first use, so that
    # loading the plugin (rota --help) imports neither the rota client nor the engine
    from rota.errors import UnsupportedVersion
    from rota_sglang._compat import FIX, SGLANG_SPEC, check_server, require_sglang
    from rota_sglang._engine import TAGS, TrackedEngine, TrackingError, track
    from rota_sglang._server import SglangServer, engine_command

__all__ = ["FIX", "SGLANG_SPEC", "TAGS", "SglangServer", "TrackedEngine", "TrackingError", "UnsupportedVersion",
           "check_server", "engine_command", "require_sglang", "track"]

_HOME = {
    "UnsupportedVersion": "rota.errors",
    "FIX": "rota_sglang._compat",
    "SGLANG_SPEC": "rota_sglang._compat",
    "check_server": "rota_sglang._compat",
    "require_sglang": "rota_sglang._compat",
    "TAGS": "rota_sglang._engine",
    "TrackedEngine": "rota_sglang._engine",
    "TrackingError": "rota_sglang._engine",
    "track": "rota_sglang._engine",
    "SglangServer": "rota_sglang._server",
    "engine_command": "rota_sglang._server",
}
__getattr__ = lazy_getattr(__name__, _HOME)
