"""The ``verl.plugins`` entry point: verl imports this on ``import verl``, in every process of a job.

It registers the ``rota_sync`` trainer (:mod:`rota_verl.trainer`) and rota's FSDP engines for
``(cuda, nvidia)`` (:mod:`rota_verl.engine`), and says so at WARNING (verl sets its logging to WARNING first,
and logs a failing plugin only at DEBUG): a job whose workers lack the plugin would silently run verl's own
engines. A failure is logged at ERROR with its cause and re-raised (verl goes on without the plugin).
Set ``VERL_USE_EXTERNAL_PLUGINS=none`` to turn every plugin off.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("rota_verl")

try:
    from rota_verl._compat import require_verl

    VERL_VERSION = require_verl()
    from rota_verl import engine, trainer
except Exception as exc:
    log.error("rota_verl: the verl plugin failed to load in pid %d: %s: %s; trainer.v1.trainer_mode=rota_sync and "
              "rota's FSDP engines are not available in this process", os.getpid(), type(exc).__name__, exc)
    raise
else:
    log.warning("rota_verl: loaded into verl %s (pid %d): trainer mode %r registered; FSDP engines for (%s, %s) "
                "park through rota_torch", VERL_VERSION, os.getpid(), trainer.NAME, engine.DEVICE, engine.VENDOR)
