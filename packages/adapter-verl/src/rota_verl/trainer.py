"""``rota_sync``: verl's synchronous PPO trainer taking rota turns, one per phase, through verl's trainer hooks.

Who uses it: verl, when a job runs with ``trainer.use_v1=True trainer.v1.trainer_mode=rota_sync`` (the
plugin registered it with ``register_trainer``). verl's v1 TaskRunner builds the trainer inside a Ray
actor, so the tenant (``rota.connect()``, from ``ROTA_*``) lives there: it is the job's one rank, and its
turns order the job against the group's other tenants.

A step of verl's ``PPOTrainerSync``: sample (the rollout replicas generate) → ``on_sample_end`` (the replicas
sleep) → reward, old/ref log-probs, advantages, the updates, a checkpoint → ``on_step_end`` (the replicas
wake and take the new weights) → validation. Here:

* **sampling turn**: taken at ``on_sample_begin``; the weight sync runs there, inside it (the replicas wake
  and take the actor's current weights), then generation; at ``on_sample_end`` the replicas sleep (verl's
  own call) and the turn is given back;
* **update turn**: taken right after (a hand-off point between the phases), held through reward, log-probs,
  advantages, the critic and actor updates and the checkpoint, given back at ``on_step_end``: verl's weight
  sync moves to the next sampling turn, so the replicas sleep between turns;
* **validation** (``on_validate_begin``/``end``): a turn of its own, with a weight sync first when the
  replicas do not hold the current weights, and the replicas put to sleep after;
* ``on_init_end``: in a turn, the replicas are put to sleep (verl syncs weights here; the first sampling
  turn does it).

Between turns the job's workers hold nothing of its state on the device: the replicas sleep, and the FSDP
engines are offloaded at every phase's end (``param_offload``/``optimizer_offload``, which this trainer
requires) through rota's engines (:mod:`rota_verl.engine`). verl's own code compares the trainer mode with
``"sync"``, so this trainer sets ``trainer.v1.trainer_mode`` back to ``sync`` for it once the registry has
picked ``rota_sync`` (the config then reads as a sync run, which it is).
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import open_dict
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

import rota

log = logging.getLogger(__name__)

__all__ = ["NAME", "OFFLOAD", "RotaPPOTrainerSync", "check_config"]

NAME = "rota_sync"
#: config keys that must be true, so the workers' state leaves the device at every phase's end
OFFLOAD = ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
           "actor_rollout_ref.ref.fsdp_config.param_offload")
CRITIC_OFFLOAD = ("critic.fsdp.param_offload", "critic.fsdp.optimizer_offload")


def _select(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = node.get(part) if hasattr(node, "get") else None
        if node is None:
            return None
    return node


def check_config(config: Any, use_critic: bool) -> None:
    """Refuse configs under which the job's state would stay on the device between turns.

    :raises ValueError: naming every override to add.
    """
    keys = OFFLOAD + (CRITIC_OFFLOAD if use_critic else ())
    missing = [k for k in keys if _select(config, k) is not True]
    if missing:
        raise ValueError(f"trainer mode {NAME!r} needs the workers' state off the device between turns; add "
                         + " ".join(f"{k}=True" for k in missing))
    sync_steps = _select(config, "trainer.v1.sync.parameter_sync_step")
    if sync_steps not in (None, 1):
        raise ValueError(f"trainer mode {NAME!r} syncs weights once per step: trainer.v1.sync.parameter_sync_step="
                         f"{sync_steps!r} is not supported; remove it (or set 1)")


@register_trainer(NAME)
class RotaPPOTrainerSync(PPOTrainerSync):
    """``PPOTrainerSync`` whose hooks take and give rota turns (see the module docs)."""

    def __init__(self, config: Any) -> None:
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"  # verl's own code paths compare with "sync"
        super().__init__(config)
        check_config(config, self.use_critic)
        self.rota_gpu: rota.Gpu | None = None
        self.rollout_current = False  # the replicas are awake and hold the actor's current weights
        #: (hook, event) in order: what the turn did at each hook ("take", "give", "sync", "sleep"), for timelines
        self.rota_log: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ turns

    def rota_connect(self) -> rota.Gpu:
        """The job's tenant (``rota.connect()`` on first use, in the process running the trainer)."""
        if self.rota_gpu is None:
            self.rota_gpu = rota.connect()
            log.warning("rota_verl: job %s takes turns in group %s (trainer mode %s)", self.rota_gpu.tenant,
                        self.rota_gpu.group, NAME)
        return self.rota_gpu

    def _take(self, hook: str) -> None:
        gpu = self.rota_connect()
        if gpu.grant is None:
            gpu.acquire()
            self.rota_log.append((hook, "take"))

    def _give(self, hook: str) -> None:
        gpu = self.rota_gpu
        if gpu is not None and gpu.grant is not None:
            gpu.release()
            self.rota_log.append((hook, "give"))

    def _sync(self, hook: str) -> None:
        if not self.rollout_current:
            self.checkpoint_manager.update_weights(self.global_steps)  # wakes the replicas, pushes the weights
            self.rollout_current = True
            self.rota_log.append((hook, "sync"))

    def _sleep(self, hook: str) -> None:
        self.checkpoint_manager.sleep_replicas()
        self.rollout_current = False
        self.rota_log.append((hook, "sleep"))

    # ------------------------------------------------------------------ verl's hooks

    def on_init_end(self) -> None:
        self._take("on_init_end")
        self._sleep("on_init_end")  # the replicas start awake; the first sampling turn syncs the weights
        self._give("on_init_end")

    def on_sample_begin(self) -> None:
        self._take("on_sample_begin")
        self._sync("on_sample_begin")

    def on_sample_end(self) -> None:
        super().on_sample_end()  # the replicas sleep (verl's own call)
        self.rollout_current = False
        self.rota_log.append(("on_sample_end", "sleep"))
        self._give("on_sample_end")
        self._take("on_sample_end")  # the update turn

    def on_step_end(self) -> None:
        self.rollout_current = False  # the actor changed: the next sampling turn syncs
        self._give("on_step_end")

    def on_validate_begin(self) -> None:
        self._take("on_validate_begin")
        self._sync("on_validate_begin")

    def on_validate_end(self) -> None:
        self._sleep("on_validate_end")
        self._give("on_validate_end")

    def on_train_end(self) -> None:
        self._give("on_train_end")
        if self.rota_gpu is not None:
            self.rota_gpu.close()
