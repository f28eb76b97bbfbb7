"""rota_verl: verl jobs take rota turns through verl's own registries, with no fork of verl.

Installed next to verl, it is loaded by ``import verl`` in every process (the ``verl.plugins`` entry point,
:mod:`rota_verl.verl_plugin`), and a job opts in with one override::

    python -m verl.trainer.main_ppo ... trainer.use_v1=True trainer.v1.trainer_mode=rota_sync \\
        actor_rollout_ref.actor.fsdp_config.param_offload=True \\
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \\
        actor_rollout_ref.ref.fsdp_config.param_offload=True

:mod:`rota_verl.trainer` (``RotaPPOTrainerSync``, a ``PPOTrainerSync``) takes a turn per phase;
:mod:`rota_verl.engine` replaces verl's FSDP engines on NVIDIA GPUs so that their offloads are rota_torch
parks. Importing this package imports no verl (``rota plugins`` lists it anywhere); the modules that
subclass verl's classes load with verl.
"""

from __future__ import annotations

from rota_verl._compat import require_verl, verl_spec

__all__ = ["require_verl", "verl_spec"]
