"""What a tenant's worker process holds: its trainer's models (forward_backward, optim_step, checkpoints) or its
sampler's weights (decoding), and what both share (:class:`WorkerBase`). The process around them, its loop and its
turns are :mod:`rota_tinker._worker.main`; the batched LoRA worker is :mod:`rota_tinker._worker.batch`."""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from rota_tinker._worker.common import MICRO_BATCH_TOKENS, UserError, WorkerSpec

log = logging.getLogger("rota_tinker.worker")


def base_model(base: Any, device: Any, shared_base: str | None) -> Any:
    """The base model: attached to the holder at ``shared_base`` (read-only, never parked), or a private copy."""
    from rota_tinker._worker.holder import attach
    from rota_tinker._worker.models import build_base

    return attach(base, device, shared_base) if shared_base else build_base(base, device)


class WorkerBase:
    """What every role holds: its device, its models, its tokenizers and its side of shared LoRA turns; the loop
    (:class:`rota_tinker._worker.loop.Loop`) reads the class attributes below to decide how units run."""

    DEVICE_OPS: frozenset[str] = frozenset()  # ops that run inside a turn
    BATCHED_OPS: frozenset[str] = frozenset()  # ops whose queued units run together (``batch_OP``)

    def __init__(self, spec: WorkerSpec, gpu: Any) -> None:
        import torch

        self.spec, self.gpu = spec, gpu
        self.device = torch.device(spec.device)
        self.models: dict[str, Any] = {}
        self.shared_turns: dict[str, Any] = {}  # a base holder's address -> this worker's SharedTurn of its base
        self.tokenizers: dict[str, Any] = {}  # base model name -> its tokenizer (loaded for stop strings)

    def _tokenizer(self, base: Any) -> Any:
        """The base model's own tokenizer (from its snapshot, offline), for stop strings."""
        if base.name not in self.tokenizers:
            from transformers import AutoTokenizer

            self.tokenizers[base.name] = AutoTokenizer.from_pretrained(base.path, local_files_only=True)
        return self.tokenizers[base.name]

    def shared_turn_of(self, op: str, args: dict[str, Any]) -> Any:
        """The shared LoRA turn ``op`` runs in (:mod:`.shared_turn`), or None: its own turn, or none at all."""
        return None

    def _shared_turn_at(self, address: str | None) -> Any:
        """This worker's side of the shared turn of the base holder at ``address`` (None: none)."""
        if address is None or self.spec.lora_concurrency <= 1:
            return None
        if address not in self.shared_turns:
            from rota_tinker._worker.shared_turn import SharedTurn

            self.shared_turns[address] = SharedTurn(address, self.device, room_for=self.spec.lora_concurrency)
        return self.shared_turns[address]

    def needs_turn(self, op: str, args: dict[str, Any]) -> bool:
        """Whether ``op`` must run inside a turn (dropping a model nobody holds needs none)."""
        if op == "unload":
            return args["model_id"] in self.models
        if op == "forget":
            return args["key"] in getattr(self, "tracked", {})
        return op in self.DEVICE_OPS

    def close(self) -> None:
        """Drop every model and this process's references to shared bases (a CUDA holder then sees them released)."""
        import torch

        from rota_tinker._worker.holder import detach_all

        self.models.clear()
        detach_all()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass
class _Trained:
    model: Any
    trainable: Any  # the module whose parameters are trained and parked (the model, or its adapters)
    optimizer: Any
    tracked: Any  # its rota_fsdp Tracked, or a _Resident (a LoRA model in a shared turn: never parked)
    lora: dict[str, Any] | None
    shared_turn: str | None = None  # the address of its base's shared LoRA turn, when its units run there


class _Resident:
    """What a LoRA model in a shared turn has instead of a ``Tracked``: adapters and Adam state stay on the device."""

    def __init__(self, trainable: Any) -> None:
        self.trainable = trainable

    def state_dict(self) -> dict[str, Any]:
        """Host copies of the adapters, as ``Tracked.state_dict()`` gives them."""
        weights = {k: v.detach().cpu().clone() for k, v in self.trainable.state_dict().items()}
        return {"model": weights, "rota": {"from_parked": False}}

    def untrack(self) -> None:
        """Nothing is tracked: dropping the model frees its tensors."""


class Trainer(WorkerBase):
    """Holds the tenant's training models; forward_backward / optim_step / save for sampler."""

    DEVICE_OPS = frozenset({"create", "forward_backward", "optim_step", "unload", "save_state", "load_state"})
    models: dict[str, _Trained]

    def shared_turn_of(self, op: str, args: dict[str, Any]) -> Any:
        """With ``lora_concurrency`` > 1, LoRA models on a shared base run their device units in its shared turn."""
        if op not in self.DEVICE_OPS:
            return None
        if op == "create":
            return self._shared_turn_at(args.get("shared_base") if args.get("lora") is not None else None)
        entry = self.models.get(args.get("model_id", ""))
        return self._shared_turn_at(entry.shared_turn if entry is not None else None)

    def op_create(self, model_id: str, base: Any, lora: dict[str, Any] | None,
                  shared_base: str | None = None, load: dict[str, Any] | None = None) -> dict[str, Any]:
        """Build a model; a LoRA model with ``shared_base`` (a holder's address) attaches to the shared base.

        ``load`` (``{"folder", "optimizer"}``): start from that training checkpoint (``load_weights``).
        """
        import torch

        import rota_fsdp
        from rota_tinker._worker.models import adapters_of, add_lora

        model = base_model(base, self.device, shared_base if lora is not None else None)
        if lora is not None:
            model = add_lora(model, lora["rank"], lora["seed"], lora["targets"])
            trainable = adapters_of(model)
        else:
            trainable = model
        opt = torch.optim.AdamW([p for p in trainable.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95),
                                eps=1e-12, weight_decay=0.0)
        shared = self._shared_turn_at(shared_base if lora is not None else None)
        if shared is not None:  # its units run beside other tenants' in a shared turn: nothing of it may be parked
            tracked: Any = _Resident(trainable)
        else:
            tracked = rota_fsdp.track(self.gpu, trainable, opt, device=self.device,
                                      release_cached=self.spec.release_cached)
        self.models[model_id] = _Trained(model, trainable, opt, tracked, lora, shared_base if shared else None)
        if load is not None:
            self.op_load_state(model_id, **load)
        n = sum(p.numel() for p in trainable.parameters() if p.requires_grad)
        log.info("model %s: %s, %d trainable parameters", model_id, "lora" if lora else "full", n)
        return {"trainable_params": n}

    def _get(self, model_id: str) -> _Trained:
        entry = self.models.get(model_id)
        if entry is None:
            raise UserError(f"model {model_id!r} is not loaded in this tenant's trainer")
        return entry

    def op_forward_backward(self, model_id: str, loss_fn: str, forward_only: bool,
                            data: list[tuple[Any, dict[str, Any]]],
                            loss_config: dict[str, float] | None = None) -> dict[str, Any]:
        """Per-datum logprobs and the summed loss; data of one length run in batches of at most
        :data:`MICRO_BATCH_TOKENS` tokens (one backward each: their logits are what takes the memory)."""
        import contextlib

        import torch

        from rota_tinker._worker.models import batch_logprobs, datum_loss

        entry = self._get(model_id)
        logprobs: list[Any] = [None] * len(data)
        losses = [0.0] * len(data)
        by_length: dict[int, list[int]] = {}
        for i, (tokens, _) in enumerate(data):
            by_length.setdefault(len(tokens), []).append(i)
        batches = [same[k:k + max(1, MICRO_BATCH_TOKENS // length)] for length, same in by_length.items()
                   for k in range(0, len(same), max(1, MICRO_BATCH_TOKENS // length))]
        for rows in batches:
            toks = torch.as_tensor(np.stack([data[i][0] for i in rows]), dtype=torch.long, device=self.device)
            targets = torch.as_tensor(np.stack([data[i][1]["target_tokens"] for i in rows]), dtype=torch.long,
                                      device=self.device)
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                lp = batch_logprobs(entry.model, toks, targets)
                loss = 0
                for b, i in enumerate(rows):
                    ins = {k: torch.as_tensor(v, device=self.device).float() for k, v in data[i][1].items()
                           if k != "target_tokens"}
                    one = datum_loss(loss_fn, lp[b], ins, loss_config)
                    losses[i] = float(one.detach())
                    loss = loss + one
            if not forward_only:
                loss.backward()
            for b, i in enumerate(rows):
                logprobs[i] = lp[b].detach().float().cpu().numpy()
        return {"logprobs": logprobs, "metrics": {"loss:sum": sum(losses)}}

    def op_optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, Any]:
        from rota_tinker._worker.models import adam_step

        return adam_step(self._get(model_id).optimizer, adam)

    def op_unload(self, model_id: str) -> dict[str, Any]:
        """Drop a model (in a turn: untracking restores a parked model first); nothing to do if it is gone."""
        entry = self.models.pop(model_id, None)
        if entry is not None:
            entry.tracked.untrack()
            del entry
            gc.collect()
        return {}

    def op_save_state(self, model_id: str, name: str, base: Any) -> dict[str, Any]:
        """Write a training checkpoint (weights and optimizer state) to ``MODEL/weights/NAME`` (in a turn)."""
        from rota_tinker._worker import state_files as _state_files

        entry = self._get(model_id)
        folder = _state_files.private_dir(os.path.join(self._model_folder(model_id), "weights"))
        path = os.path.join(folder, name)
        return {"folder": path, "bytes": _state_files.write(path, entry, base)}

    def op_load_state(self, model_id: str, folder: str, optimizer: bool) -> dict[str, Any]:
        """Load a training checkpoint into the model in place (in a turn)."""
        from rota_tinker._worker import state_files as _state_files

        try:
            _state_files.read(folder, self._get(model_id), optimizer)
        except (ValueError, FileNotFoundError) as e:
            raise UserError(str(e)) from e
        return {}

    def _model_folder(self, model_id: str) -> str:
        from rota_tinker._worker.state_files import private_dir

        return private_dir(os.path.join(self.spec.data_dir, self.spec.tenant, model_id))

    def op_save_for_sampler(self, model_id: str, name: str, base: Any) -> dict[str, Any]:
        """Write sampler weights ``MODEL/sampler_weights/NAME`` (a checkpoint without the optimizer state) from the
        tracked host copy: no turn, no device (a parked model is read where it is parked)."""
        from rota_tinker._worker import state_files as _state_files

        entry = self._get(model_id)
        state = entry.tracked.state_dict()
        folder = _state_files.private_dir(os.path.join(self._model_folder(model_id), "sampler_weights"))
        path = os.path.join(folder, name)
        size = _state_files.write(path, entry, base, weights=state["model"], optimizer=False)
        return {"file": path, "bytes": size, "from_parked": state["rota"]["from_parked"]}


class Sampler(WorkerBase):
    """Holds the tenant's sampling models (one per sampling session's weights: file or "base:NAME" -> model)."""

    DEVICE_OPS = frozenset({"sample", "forget"})
    BATCHED_OPS = frozenset({"sample"})

    def __init__(self, spec: WorkerSpec, gpu: Any) -> None:
        super().__init__(spec, gpu)
        self.tracked: dict[str, Any] = {}  # key -> its Tracked (not for a bare shared base: nothing is parked)

    def shared_turn_of(self, op: str, args: dict[str, Any]) -> Any:
        """With ``lora_concurrency`` > 1, sampling on a shared base (LoRA weights or the base) runs in its shared turn;
        such a model is never tracked, so forgetting it needs no turn."""
        return self._shared_turn_at(args.get("shared_base")) if op == "sample" else None

    def op_forget(self, key: str) -> dict[str, Any]:
        """Drop the model of deleted weights (in a turn when it is tracked); nothing to do if it was never loaded."""
        tracked = self.tracked.pop(key, None)
        if tracked is not None:
            tracked.untrack()
        if self.models.pop(key, None) is not None:
            gc.collect()
        return {}

    def _load(self, key: str, base: Any, shared_base: str | None) -> Any:
        """The model of ``key``; ``shared_base`` (LoRA weights or the bare base only): attach to the shared base."""
        import rota_fsdp
        from rota_tinker._worker import state_files as _state_files
        from rota_tinker._worker.models import adapters_of, add_lora

        if key in self.models:
            return self.models[key]
        model = base_model(base, self.device, shared_base)
        parked = None if shared_base else model  # a shared base is never parked; only an adapter on it
        if not key.startswith("base:"):  # a folder of sampler weights (rota_tinker._worker.state_files)
            lora = _state_files.saved_lora(key)
            if lora is not None:
                model = add_lora(model, lora["rank"], lora["seed"], lora["targets"])
                parked = adapters_of(model)
            elif shared_base:
                raise UserError(f"{key} holds full-parameter weights; they cannot go on a shared base")
            _state_files.read_weights(key, model, lora)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        if parked is not None and self._shared_turn_at(shared_base) is None:  # in a shared turn: resident, never parked
            self.tracked[key] = rota_fsdp.track(self.gpu, parked, None, tags=("weights",), device=self.device,
                                                release_cached=self.spec.release_cached)
        self.models[key] = model
        return model

    def batch_sample(self, units: list[dict[str, Any]]) -> list[dict[str, Any] | Exception]:
        """The sample units of one turn: those on the same weights (``key``) decode together as one batch
        (split where prompt logprobs would pass :data:`MICRO_BATCH_TOKENS` logits rows: see
        :func:`rota_tinker._worker.sampling.decode_batches`).

        Each unit (``key``, ``base``, ``prompt``, ``params``, ``num_samples``, ``seed``, ``shared_base``)
        gets its own result, or the exception that failed it (parameters out of bounds, or a draw that failed on
        its rows: that request alone) or its batch (weights that cannot load, say); a result's ``timing`` gives
        the units and rows of the decode batch it was in.
        """
        from rota_tinker._worker.sampling import check_params, decode_batches, sample

        out: list[dict[str, Any] | Exception] = [None] * len(units)  # type: ignore[list-item]
        groups: dict[str, list[int]] = {}
        for i, unit in enumerate(units):
            try:
                check_params(unit["params"])  # a request out of bounds fails alone, before it joins a batch
            except UserError as e:
                out[i] = e
                continue
            groups.setdefault(unit["key"], []).append(i)
        batches = [[rows[j] for j in part] for rows in groups.values()
                   for part in decode_batches([units[i] for i in rows], MICRO_BATCH_TOKENS)]
        for rows in batches:
            key = units[rows[0]]["key"]
            base = units[rows[0]]["base"]
            try:
                model = self._load(key, base, units[rows[0]].get("shared_base"))
                tokenizer = self._tokenizer(base) if any(units[i]["params"].get("stop_strings") for i in rows) else None
                results: list[Any] = sample(model, [units[i] for i in rows], self.device, base.max_len, tokenizer)
            except Exception as e:
                results = [e] * len(rows)
            for i, result in zip(rows, results, strict=True):
                if isinstance(result, dict):
                    result["timing"] = {"batch_units": float(len(rows)), "decode_rows": float(result.pop("rows"))}
                out[i] = result
        return out
