"""``RotaCallback``: a ``transformers.TrainerCallback`` that makes a Trainer (SFT, GRPO, DPO, plain) a rota tenant.

Who calls it: a training script, with one line, ``trainer.add_callback(rota_trl.RotaCallback(trainer))``.

* ``on_train_begin``: checks the TRL version, connects (``rota.connect()``, or the ``gpu`` given), tracks the
  model with its optimizer (``rota_fsdp.track``: weights, grads, optimizer state) and, when the trainer is
  given, its frozen extra models (``ref_model``, ``teacher_model``, ``nn.Module`` reward models: weights
  only) and its colocated vLLM engine (:mod:`rota_trl._engine`); then takes the first turn.
* one turn per optimizer step: taken at ``on_step_begin`` (a turn still held is given back first, so every
  step boundary is a hand-off), given back at ``on_step_end``, unless the step ends with an evaluation, a
  checkpoint or the end of training, which then run inside the same turn (also those at an epoch's end).
* ``on_train_end``: takes the turn if needed (the model is restored), untracks everything, gives the turn
  back and leaves (``gpu.close()``, unless the ``gpu`` was given): after ``train()`` the model is an ordinary
  model on its device, for ``save_model``, ``evaluate`` or ``push_to_hub``.

Between turns the orchestrator may park the job (with no ``--capacity``: whenever another job takes the
turn), so nothing may touch the model's tensors there: ``trainer.evaluate()`` or ``predict()`` called outside
``train()`` run after ``on_train_end``, when the model is untracked. ``train()`` that raises leaves the turn
held until :meth:`RotaCallback.close` or the process's exit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

import rota
from rota_trl._compat import require_trl
from rota_trl._engine import ColocatedEngine, engine_bytes, engine_of
from rota_trl._offturn import OffTurn, register_active, unregister_active

log = logging.getLogger(__name__)

__all__ = ["EXTRA_MODELS", "RotaCallback"]

#: Attributes of a TRL trainer holding frozen models on the device (parked with the job, weights only).
EXTRA_MODELS = ("ref_model", "teacher_model")


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (its public ``optimizer``)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "state") else optimizer


class RotaCallback(TrainerCallback):
    """Time-slices a ``transformers.Trainer`` (any TRL trainer) through rota: one turn per optimizer step.

    :param trainer: the trainer, for the models it keeps beside ``model`` (reference, teacher, reward models)
        and its colocated vLLM engine; needed for GRPO with ``use_vllm=True, vllm_mode="colocate"`` and for
        trainers with a reference model. Without it only the model and its optimizer are tracked.
    :param gpu: the tenant to use (default: ``rota.connect()`` at ``on_train_begin``, from ``ROTA_*``).
    :param track: keywords for ``rota_fsdp.track`` of the model (``discard=("grads",)``, ``verify=``...).
    """

    def __init__(self, trainer: Any = None, *, gpu: rota.Gpu | None = None, **track: Any) -> None:
        self.trainer, self.gpu, self.track_knobs = trainer, gpu, track
        self.own_gpu = gpu is None
        self.handles: list[Any] = []  # rota_torch.Tracked of the model and the extra models
        self.engine: ColocatedEngine | None = None
        self.tracked: list[str] = []  # what the last on_train_begin tracked (kept after close, for reports)
        self.gate = OffTurn(self)
        self.steps = 0  # turns taken at on_step_begin
        self._lock = threading.RLock()  # the training thread and off-turn reward calls share the turn

    # ------------------------------------------------------------------ the turn

    @property
    def tenant(self) -> str:
        return self.gpu.tenant if self.gpu is not None else "<not connected>"

    @property
    def holding(self) -> bool:
        """True while this job holds its turn."""
        return self.gpu is not None and self.gpu.grant is not None

    def take_turn(self) -> None:
        """Take the job's turn (restoring parked state first); nothing when held."""
        with self._lock:
            if self.gpu is not None and self.gpu.grant is None:
                self.gpu.acquire()

    def give_turn(self) -> bool:
        """Give the turn back if held; True when it was."""
        with self._lock:
            if self.gpu is None or self.gpu.grant is None:
                return False
            self.gpu.release()
            return True

    def off_turn(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run without this job's turn (see :func:`rota_trl.off_turn`), bound to this callback."""
        return self.gate.wrap(fn)

    # ------------------------------------------------------------------ events

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        require_trl()
        llm = self._check_generation(args)
        if self.gpu is None:
            self.gpu = rota.connect()
            self.own_gpu = True
        import rota_fsdp

        try:
            self.handles.append(rota_fsdp.track(self.gpu, model, _unwrap_optimizer(optimizer), **self.track_knobs))
            for extra in self._extra_models(model):
                self.handles.append(rota_fsdp.track(self.gpu, extra, None, tags=("weights",)))
            if llm is not None:
                self.engine = ColocatedEngine(self.gpu, llm, engine_bytes(llm))
                self.gpu.pm.register(self.engine, name=self.engine.name)
        except Exception:
            self._untrack()
            raise
        self.tracked = [type(h.model).__name__ for h in self.handles] + (["vllm_engine"] if llm is not None else [])
        register_active(self)
        log.info("job %s: %s is a rota tenant (%d model(s) tracked%s); one turn per optimizer step",
                 self.gpu.tenant, type(self.trainer or model).__name__, len(self.handles),
                 ", its vLLM engine parked with it" if llm is not None else "")
        self.take_turn()  # setup to the first step (and eval_on_start) inside the turn

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self._lock:
            self.give_turn()  # a turn kept for the last step's evaluation or checkpoint: hand off here
            self.take_turn()
            self.steps += 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._work_after(control, state):
            self.give_turn()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._work_after(control, state):
            self.take_turn()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop time-slicing: restore the state (in a turn), untrack it, give the turn back, leave.

        Called at ``on_train_end``; call it yourself after a ``train()`` that raised. Idempotent.
        """
        with self._lock:
            unregister_active(self)
            if self.gpu is None:
                return
            if self.handles or self.engine is not None:
                self.take_turn()  # a parked state comes back on the device before it is untracked
            self._untrack()
            self.give_turn()
            if self.own_gpu:
                self.gpu.close()

    # ------------------------------------------------------------------ parts

    @staticmethod
    def _work_after(control: Any, state: Any) -> bool:
        """Whether the trainer will touch the model after this event (evaluation, a checkpoint, the end)."""
        return bool(control.should_evaluate or control.should_save or control.should_training_stop
                    or (state.max_steps and state.global_step >= state.max_steps))

    def _check_generation(self, args: Any) -> Any:
        """The colocated vLLM engine to park with the job, or None; refuses setups whose memory rota cannot free."""
        if not getattr(args, "use_vllm", False):
            return None
        mode = getattr(args, "vllm_mode", None)
        if mode != "colocate":
            log.info("vllm_mode=%r: the vLLM server is its own tenant (rota vllm serve, in its own group); this "
                     "callback parks the trainer only", mode)
            return None
        if not getattr(args, "vllm_enable_sleep_mode", False):
            raise ValueError("rota_trl: use_vllm=True with vllm_mode='colocate' needs vllm_enable_sleep_mode=True in "
                             "the GRPOConfig, so TRL frees the engine's memory after each generation; without it the "
                             "engine keeps its memory on the device between turns")
        llm = engine_of(self.trainer)
        if llm is None:
            raise ValueError("rota_trl: vllm_mode='colocate' keeps a vLLM engine in this process; pass the trainer "
                             "so it is parked with the job: trainer.add_callback(rota_trl.RotaCallback(trainer))")
        return llm

    def _extra_models(self, model: Any) -> list[Any]:
        """The trainer's other models on the device: reference, teacher, and nn.Module reward models."""
        if self.trainer is None:
            return []
        import torch

        found: list[Any] = []
        candidates = [getattr(self.trainer, name, None) for name in EXTRA_MODELS]
        candidates += list(getattr(self.trainer, "reward_funcs", None) or ())
        for m in candidates:
            if isinstance(m, torch.nn.Module) and m is not model and all(m is not f for f in found):
                found.append(m)
        return found

    def _untrack(self) -> None:
        for handle in reversed(self.handles):
            handle.untrack()
        self.handles.clear()
        if self.engine is not None and self.gpu is not None:
            if self.gpu.pm.get_plugin(self.engine.name) is not None:
                self.gpu.pm.unregister(name=self.engine.name)
            self.engine = None

    def __repr__(self) -> str:
        return f"RotaCallback(tenant={self.tenant!r}, tracked={len(self.handles)}, holding={self.holding})"
