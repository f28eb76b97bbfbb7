"""One worker process: the trainer or the sampler of one tenant.

Started by :mod:`rota_tinker._workers` with the ``spawn`` method; talks to the HTTP
process over a ``multiprocessing`` pipe: requests ``(request_id, op, args)``, replies
``(request_id, "ok", result)`` or ``(request_id, "err", message, category)``. Work
units run one at a time, in arrival order.

Every device work unit (creating a model, ``forward_backward``, ``optim_step``, a
sampling batch) runs inside ``gpu.turn()`` of the tenant's rota tenant
(``<tenant>.trainer`` / ``<tenant>.sampler``) on the service's group, so tenants take
turns on shared devices. What is parked between turns (by :mod:`rota_fsdp`):

* full-parameter models: weights, grads and the Adam state;
* LoRA models: only the adapter weights and their Adam state; the base model stays
  resident (it is never trained);
* sampler models: the weights a sampling session samples from (the adapter only, for
  LoRA).

LoRA models (and base-only samplers) do not load their own base when the service shares
bases (the default): they :func:`rota_tinker._base.attach` to the resident copy of the
base-holder process of their (device, base), which is role ``base`` here (no rota
tenant: the base is resident, never parked, and read-only).

Saving weights for the sampler needs no device: it is written from the tracked host
copy (``Tracked.state_dict()``), without a turn.
"""

from __future__ import annotations

import logging
import os
import secrets
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("rota_tinker.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; picklable for ``spawn``."""

    tenant: str
    role: str  # "trainer" | "sampler" | "base" (a base holder: rota_tinker._base.BaseHolder)
    group: str
    endpoint: str | None
    device: str
    data_dir: str
    torch_threads: int = 1
    base: Any = None  # the BaseModelSpec a base holder holds (role "base" only)


class UserError(Exception):
    """The request was wrong (reported to the client with category ``user``)."""


def main(spec: WorkerSpec, conn: Connection) -> None:
    """Worker entry point (the ``spawn`` target)."""
    logging.basicConfig(level=os.environ.get("ROTA_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s {spec.tenant}.{spec.role} %(levelname)s %(name)s: %(message)s")
    import torch

    import rota

    torch.set_num_threads(spec.torch_threads)
    gpu = None
    if spec.role == "base":
        from rota_tinker._base import BaseHolder

        worker: Any = BaseHolder(spec)
        hello = worker.hello()
    else:
        gpu = rota.connect(group=spec.group, tenant=f"{spec.tenant}.{spec.role}", endpoint=spec.endpoint)
        worker = (Trainer if spec.role == "trainer" else Sampler)(spec, gpu)
        hello = {}
    conn.send(("ready", os.getpid(), hello))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        rid, op, args = msg
        try:
            result = getattr(worker, f"op_{op}")(**args)
            conn.send((rid, "ok", result))
        except UserError as e:
            conn.send((rid, "err", str(e), "user"))
        except Exception as e:
            log.error("%s failed: %s", op, traceback.format_exc())
            conn.send((rid, "err", f"{type(e).__name__}: {e}", "server"))
    if gpu is not None:
        gpu.close()


def _base_model(base: Any, device: Any, shared_base: str | None) -> Any:
    """The base model: attached to the holder at ``shared_base`` (read-only, never parked), or a private copy."""
    from rota_tinker._base import attach
    from rota_tinker._models import build_base

    return attach(base, device, shared_base) if shared_base else build_base(base, device)


class _Base:
    def __init__(self, spec: WorkerSpec, gpu: Any) -> None:
        import torch

        self.spec, self.gpu = spec, gpu
        self.device = torch.device(spec.device)


@dataclass
class _Trained:
    model: Any
    trainable: Any  # the module whose parameters are trained and parked (the model, or its adapters)
    optimizer: Any
    tracked: Any
    lora: dict[str, Any] | None


class Trainer(_Base):
    """Holds the tenant's training models; forward_backward / optim_step / save for sampler."""

    def __init__(self, spec: WorkerSpec, gpu: Any) -> None:
        super().__init__(spec, gpu)
        self.models: dict[str, _Trained] = {}

    def op_create(self, model_id: str, base: Any, lora: dict[str, Any] | None,
                  shared_base: str | None = None) -> dict[str, Any]:
        """Build a model; a LoRA model with ``shared_base`` (a holder's address) attaches to the shared base."""
        import torch

        import rota_fsdp
        from rota_tinker._models import add_lora

        with self.gpu.turn():
            model = _base_model(base, self.device, shared_base if lora is not None else None)
            if lora is not None:
                trainable = add_lora(model, lora["rank"], lora["seed"], lora["targets"])
            else:
                trainable = model
            opt = torch.optim.AdamW(trainable.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
            tracked = rota_fsdp.track(self.gpu, trainable, opt, device=self.device)
        self.models[model_id] = _Trained(model, trainable, opt, tracked, lora)
        n = sum(p.numel() for p in trainable.parameters())
        log.info("model %s: %s, %d trainable parameters", model_id, "lora" if lora else "full", n)
        return {"trainable_params": n}

    def _get(self, model_id: str) -> _Trained:
        entry = self.models.get(model_id)
        if entry is None:
            raise UserError(f"model {model_id!r} is not loaded in this tenant's trainer")
        return entry

    def op_forward_backward(self, model_id: str, loss_fn: str, forward_only: bool,
                            data: list[tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
        import torch

        from rota_tinker._models import datum_loss, token_logprobs

        entry = self._get(model_id)
        logprobs, total = [], 0.0
        with self.gpu.turn():
            for tokens, inputs in data:
                toks = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
                ins = {k: torch.as_tensor(v, device=self.device) for k, v in inputs.items()}
                targets = ins.pop("target_tokens").long()
                ins = {k: v.float() for k, v in ins.items()}
                if forward_only:
                    with torch.no_grad():
                        lp = token_logprobs(entry.model, toks, targets)
                        loss = datum_loss(loss_fn, lp, ins)
                else:
                    lp = token_logprobs(entry.model, toks, targets)
                    loss = datum_loss(loss_fn, lp, ins)
                    loss.backward()
                total += float(loss.detach())
                logprobs.append(lp.detach().float().cpu().numpy())
        return {"logprobs": logprobs, "metrics": {"loss:sum": total}}

    def op_optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, Any]:
        import torch

        entry = self._get(model_id)
        with self.gpu.turn():
            params = [p for p in entry.trainable.parameters() if p.requires_grad]
            norm = None
            if adam["grad_clip_norm"] > 0:
                norm = float(torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"]))
            for group in entry.optimizer.param_groups:
                group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                             weight_decay=adam["weight_decay"])
            entry.optimizer.step()
            entry.optimizer.zero_grad(set_to_none=False)
        metrics = {} if norm is None else {"grad_norm:mean": norm}
        return {"metrics": metrics}

    def op_save_for_sampler(self, model_id: str, name: str) -> dict[str, Any]:
        import torch

        entry = self._get(model_id)
        state = entry.tracked.state_dict()  # from the parked host copy when parked: no turn, no device
        folder = os.path.join(self.spec.data_dir, self.spec.tenant, model_id)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{name}.pt")
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        torch.save({"weights": state["model"], "lora": entry.lora}, tmp)
        os.replace(tmp, path)
        return {"file": path, "from_parked": state["rota"]["from_parked"]}


class Sampler(_Base):
    """Holds the tenant's sampling models (one per sampling session's weights)."""

    def __init__(self, spec: WorkerSpec, gpu: Any) -> None:
        super().__init__(spec, gpu)
        self.models: dict[str, Any] = {}  # weights file (or "base:NAME") -> model

    def _load(self, key: str, base: Any, shared_base: str | None) -> Any:
        """The model of ``key``; ``shared_base`` (LoRA weights or the bare base only): attach to the shared base."""
        import torch

        import rota_fsdp
        from rota_tinker._models import add_lora

        if key in self.models:
            return self.models[key]
        model = _base_model(base, self.device, shared_base)
        parked = None if shared_base else model  # a shared base is never parked; only an adapter on it
        if not key.startswith("base:"):
            saved = torch.load(key, map_location=self.device, weights_only=True)
            if saved["lora"] is not None:
                lora = saved["lora"]
                parked = add_lora(model, lora["rank"], lora["seed"], lora["targets"])
            elif shared_base:
                raise UserError(f"{key} holds full-parameter weights; they cannot go on a shared base")
            (parked or model).load_state_dict(saved["weights"])
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        if parked is not None:
            rota_fsdp.track(self.gpu, parked, None, tags=("weights",), device=self.device)
        self.models[key] = model
        return model

    def op_sample(self, key: str, base: Any, prompt: Any, params: dict[str, Any], num_samples: int,
                  seed: int, shared_base: str | None = None) -> list[Any]:
        from rota_tinker._models import sample

        with self.gpu.turn():
            model = self._load(key, base, shared_base)
            return sample(model, prompt, params, num_samples, seed, self.device, base.max_len)
