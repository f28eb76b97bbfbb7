"""rota_trl: any ``transformers.Trainer`` (TRL's SFT, GRPO, DPO... or a plain one) takes turns on a GPU through rota.

One line in a training script::

    trainer.add_callback(rota_trl.RotaCallback(trainer))
    trainer.train()

The model, its gradients and optimizer state (and the trainer's reference/teacher/reward models and
colocated vLLM engine) are tracked from ``on_train_begin``; the job holds one turn per optimizer step and
may be parked between steps. A slow host-side reward gives the turn back while it runs::

    GRPOTrainer(..., reward_funcs=[rota_trl.off_turn(judge)])

The supported TRL range is rota-adapter-trl's dependency (:func:`trl_spec`), checked when training starts.
Importing this package imports neither transformers nor TRL: the names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr
from rota.errors import UnsupportedVersion
from rota_trl._compat import require_trl, trl_spec
from rota_trl._offturn import off_turn

if TYPE_CHECKING:
    from rota_trl._callback import EXTRA_MODELS, RotaCallback
    from rota_trl._engine import ColocatedEngine, EngineAwake

__all__ = ["EXTRA_MODELS", "ColocatedEngine", "EngineAwake", "RotaCallback", "UnsupportedVersion", "off_turn",
           "require_trl", "trl_spec"]

_HOME = {"EXTRA_MODELS": "rota_trl._callback", "RotaCallback": "rota_trl._callback",
         "ColocatedEngine": "rota_trl._engine", "EngineAwake": "rota_trl._engine"}
__getattr__ = lazy_getattr(__name__, _HOME)  # transformers loads with the callback, not with `rota plugins`
