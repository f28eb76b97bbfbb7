"""rota_vllm: vLLM inference engines that take turns on GPUs with trainers, through rota.

Two shapes:

* **In-process** (``vllm.LLM``)::

      import rota, rota_vllm
      gpu = rota.connect()
      with gpu.turn(quiet=True):                    # vLLM profiles free memory as it starts
          llm = LLM(model, enable_sleep_mode=True)
          engine = rota_vllm.track(gpu, llm)        # park = llm.sleep(1|2), restore = wake_up
      for step in range(n):
          with gpu.turn():
              engine.update_weights(trainer_weights)  # RL weight sync (collective_rpc)
              rollouts = llm.generate(prompts, params)

  The sleep level follows the park plan: OFFLOAD → level 1 (weights to host, KV cache
  dropped), DISCARD → level 2 (both dropped); ``track(..., mode="discard")`` forces it.

* **Server** (``rota vllm serve -- <vllm args>``): starts
  ``python -m vllm.entrypoints.openai.api_server --enable-sleep-mode`` with
  ``VLLM_SERVER_DEV_MODE=1`` on an internal port, joins rota as a tenant (and
  registers with the node agent when ``ROTA_AGENT`` is set and rota-agent is installed), and serves a proxy in
  front of it: a request that arrives while the engine is parked waits for the
  engine's turn and then runs; the turn is given back when requests stop.
  :class:`VllmServer` pushes new weights into a served engine.

vLLM is an optional extra (``pip install "rota-adapter-vllm[vllm]"``); nothing here
imports it at import time. The serving machinery (proxy, turn gate, supervisor) is
:mod:`rota_serving`'s, shared with rota_sglang; it is re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time each loads on first use, so that
    # loading the plugin (rota --help) imports neither the rota client nor the engine
    from rota.errors import UnsupportedVersion
    from rota_serving import EndpointClient, ServeConfig, Served, ServingError, TurnGate, TurnProxy, serve_app
    from rota_vllm._compat import FIX, VLLM_SPEC, check_server, require_vllm
    from rota_vllm._llm import BACKUPS, TAGS, TrackedLLM, TrackingError, awake_footprint, track
    from rota_vllm._pinned import WeightStash, worker_stash
    from rota_vllm._server import RotaBackupServer, VllmServer, engine_command

__all__ = ["BACKUPS", "FIX", "TAGS", "VLLM_SPEC", "EndpointClient", "RotaBackupServer", "ServeConfig", "Served",
           "ServingError", "TrackedLLM", "TrackingError", "TurnGate", "TurnProxy", "UnsupportedVersion", "VllmServer",
           "WeightStash", "awake_footprint", "check_server", "engine_command", "require_vllm", "serve_app", "track",
           "worker_stash"]

_HOME = {
    "UnsupportedVersion": "rota.errors",
    "EndpointClient": "rota_serving",
    "ServeConfig": "rota_serving",
    "Served": "rota_serving",
    "ServingError": "rota_serving",
    "TurnGate": "rota_serving",
    "TurnProxy": "rota_serving",
    "serve_app": "rota_serving",
    "FIX": "rota_vllm._compat",
    "VLLM_SPEC": "rota_vllm._compat",
    "check_server": "rota_vllm._compat",
    "require_vllm": "rota_vllm._compat",
    "BACKUPS": "rota_vllm._llm",
    "TAGS": "rota_vllm._llm",
    "TrackedLLM": "rota_vllm._llm",
    "TrackingError": "rota_vllm._llm",
    "awake_footprint": "rota_vllm._llm",
    "track": "rota_vllm._llm",
    "WeightStash": "rota_vllm._pinned",
    "worker_stash": "rota_vllm._pinned",
    "VllmServer": "rota_vllm._server",
    "RotaBackupServer": "rota_vllm._server",
    "engine_command": "rota_vllm._server",
}
__getattr__ = lazy_getattr(__name__, _HOME)
