"""The batched LoRA worker: every tenant's LoRA models on one shared base, trained in batched passes.

With ``ServiceConfig.lora_batch`` the service sends the units of LoRA models on a shared base to one
worker process per (base, device) instead of each tenant's trainer. It attaches to the base holder's
copy of the base (:mod:`rota_tinker._worker.holder`) and holds every such model's adapters and AdamW state in
one :class:`rota_tinker._worker.multilora.BatchedLora`. What runs when is its loop's
(:class:`rota_tinker._worker.passes.BatchLoop`: passes that each take a bounded share of every tenant's queued
work); this module is what a pass calls:

* :meth:`BatchTrainer.train`: ``forward_backward`` parts of many models as one batched pass;
* ``op_optim_step``: one model's own AdamW;
* :meth:`BatchTrainer.open_decoding`: ``sample`` units (from LoRA sampler weights or the bare base, of any
  tenant) as one decode batch, each row with its own weights' adapters, loaded from their folder on first use
  and **pinned** until the decoding ends (the least recently used unpinned ones are let go past
  :data:`MAX_WEIGHTS`; a decoding never needs more than that many: the loop admits no more);
* model operations (create, unload, checkpoints) one at a time.

The worker is one rota tenant (``lora-batch.N``): its batch takes turns against full-parameter
tenants and samplers on the device, like the shared LoRA turn (:mod:`rota_tinker._worker.shared_turn`). Adapters and
Adam state stay on the device for a model's life (a few hundred MB per tenant on a 1.7B base: they
are never parked, like the base). Checkpoints are the trainers' files (peft's adapter files and
``optimizer.pt`` in the same parameter order), so a model moves between this worker and a trainer
either way.
"""

from __future__ import annotations

import gc
import itertools
import os
from collections import Counter, OrderedDict
from typing import Any

from rota_tinker._worker.common import UserError
from rota_tinker._worker.multilora import BatchedLora, Unit
from rota_tinker._worker.roles import WorkerBase, base_model

__all__ = ["BatchTrainer"]

MAX_WEIGHTS = 256  # sampler weights whose adapters stay loaded (least recently used unpinned ones go first)


class BatchTrainer(WorkerBase):
    """The LoRA models of every tenant on one shared base (see the module docs)."""

    DEVICE_OPS = frozenset({"create", "forward_backward", "optim_step", "unload", "save_state", "load_state",
                            "save_for_sampler", "sample", "forget"})
    BATCHED_OPS = frozenset({"forward_backward", "optim_step", "sample"})  # what a pass takes together

    def __init__(self, spec: Any, gpu: Any) -> None:
        super().__init__(spec, gpu)
        self.batched: BatchedLora | None = None
        self.owners: dict[str, tuple[str, dict[str, Any], Any]] = {}  # model id -> (tenant, lora, base)
        self.weights: OrderedDict[str, str] = OrderedDict()  # sampler weights' folder -> its adapters' name, LRU
        self.pins: Counter[str] = Counter()  # sampler weights' folder -> decodings in flight that use it
        self.forgotten: set[str] = set()  # weights deleted while pinned: let go when their last decoding ends
        self.loaded = itertools.count()  # names adapters of sampler weights uniquely

    def needs_turn(self, op: str, args: dict[str, Any]) -> bool:
        if op == "unload":
            return args["model_id"] in self.owners
        if op == "forget":
            return args["key"] in self.weights or args["key"] in self.forgotten
        return op in self.DEVICE_OPS

    # ------------------------------------------------------------------ models

    def _batched(self, base: Any, shared_base: str | None) -> BatchedLora:
        if shared_base is None:
            raise UserError("the batched LoRA worker needs the shared base (share_lora_base)")
        if self.batched is None:
            self.batched = BatchedLora(base_model(base, self.device, shared_base), self.device)
            self.base_name = base.name
        elif base.name != self.base_name:
            raise UserError(f"this batched worker holds base {self.base_name!r}, not {base.name!r}")
        return self.batched

    def _get(self, model_id: str) -> tuple[str, dict[str, Any], Any]:
        if model_id not in self.owners:
            raise UserError(f"model {model_id!r} is not loaded in the batched LoRA worker")
        return self.owners[model_id]

    def op_create(self, model_id: str, base: Any, lora: dict[str, Any] | None, tenant: str,
                  shared_base: str | None = None, load: dict[str, Any] | None = None) -> dict[str, Any]:
        """Add a model's adapters, as peft starts them from its seed; ``load``: then that checkpoint's."""
        if lora is None:
            raise UserError("the batched LoRA worker holds LoRA models only")
        batched = self._batched(base, shared_base)
        n = batched.add(model_id, lora["rank"], lora["seed"], lora["targets"])
        self.owners[model_id] = (tenant, lora, base)
        if load is not None:
            try:
                self.op_load_state(model_id, **load)
            except BaseException:
                self.op_unload(model_id)
                raise
        return {"trainable_params": n}

    def op_unload(self, model_id: str) -> dict[str, Any]:
        if self.owners.pop(model_id, None) is not None and self.batched is not None:
            self.batched.remove(model_id)
            gc.collect()
        return {}

    def op_optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, Any]:
        self._get(model_id)
        assert self.batched is not None
        return self.batched.optim_step(model_id, adam)

    # ------------------------------------------------------------------ a pass

    def owner_of(self, model_id: str) -> str | None:
        """The tenant (API key) whose model ``model_id`` is; None if this worker does not hold it."""
        entry = self.owners.get(model_id)
        return entry[0] if entry is not None else None

    def train(self, parts: list[Unit]) -> list[dict[str, Any]]:
        """``forward_backward`` parts of many models (``Unit.tenant``: the model id) as one batched pass: each
        part's per-datum logprobs and ``loss:sum``. A failure fails the whole pass (what its earlier micro-batches
        added to gradients stays, as in a trainer process).

        :raises UserError: a part's model is not loaded here (callers check :meth:`owner_of` first).
        """
        for part in parts:
            self._get(part.tenant)
        assert self.batched is not None
        return self.batched.forward_backward(parts)

    def can_pin(self, keys: set[str]) -> bool:
        """Whether a decoding of sampler weights ``keys`` (folders; ``base:`` keys need no adapters) fits beside
        the weights pinned by the decodings in flight: at most :data:`MAX_WEIGHTS` held at once."""
        wanted = {k for k in keys if not k.startswith("base:")}
        return len(wanted | {k for k, n in self.pins.items() if n}) <= MAX_WEIGHTS

    def open_decoding(self, units: list[dict[str, Any]]) -> tuple[Any, list[Exception | None]]:
        """A decode batch of ``units`` (the ``sample`` units' arguments), or None when none of them can run; and
        each unit's error (None: it is in the batch). A unit whose parameters are out of bounds or whose weights
        cannot load fails alone; the weights of those in the batch stay pinned until :meth:`close_decoding`."""
        from rota_tinker._worker.sampling import check_params

        errors: list[Exception | None] = [None] * len(units)
        requests, keys = [], []
        for i, unit in enumerate(units):
            try:
                check_params(unit["params"])
                name = self._sampler_weights(unit)
            except Exception as e:
                errors[i] = e
                continue
            self.pins[unit["key"]] += 1  # before the next unit loads: nothing this batch needs is let go
            keys.append(unit["key"])
            requests.append({**unit, "tenant": name})
        if not requests:
            return None, errors
        base = requests[0]["base"]
        tokenizer = self._tokenizer(base) if any(r["params"].get("stop_strings") for r in requests) else None
        try:
            assert self.batched is not None
            decoding = self.batched.decoding(requests, base.max_len, tokenizer)
        except Exception:
            self._unpin(keys)
            raise
        decoding.pinned = keys
        return decoding, errors

    def close_decoding(self, decoding: Any) -> None:
        """A decode batch ended (or failed): its weights are no longer pinned by it."""
        self._unpin(decoding.pinned)
        decoding.pinned = []

    def _unpin(self, keys: list[str]) -> None:
        for key in keys:
            self.pins[key] -= 1
            if self.pins[key] <= 0:
                del self.pins[key]
                if key in self.forgotten:  # deleted while a decoding used it
                    self.forgotten.discard(key)
                    self.op_forget(key)

    def _sampler_weights(self, unit: dict[str, Any]) -> str | None:
        """The batch's name of the adapters ``unit`` samples from (loaded from its folder on first use, the least
        recently used unpinned ones let go past :data:`MAX_WEIGHTS`); None for the bare base."""
        from safetensors.torch import load_file

        from rota_tinker._worker.state_files import saved_lora

        batched = self._batched(unit["base"], unit.get("shared_base"))
        key = unit["key"]
        if key.startswith("base:"):
            return None
        if key in self.weights:
            self.weights.move_to_end(key)
            return self.weights[key]
        lora = saved_lora(key)
        if lora is None:
            raise UserError(f"{os.path.basename(key)} holds full-parameter weights; they cannot go on a shared base")
        name = f"weights:{next(self.loaded)}:{os.path.basename(key)}"
        batched.add(name, lora["rank"], lora["seed"], lora["targets"])
        try:
            batched.load(name, load_file(os.path.join(key, "adapter_model.safetensors")))
        except (ValueError, FileNotFoundError) as e:
            batched.remove(name)
            raise UserError(str(e)) from e
        for p in batched.adapters[name].parameters():  # frozen: no gradient (its AdamW never steps: no state)
            p.requires_grad_(False)
            p.grad = None
        self.weights[key] = name
        idle = [k for k in self.weights if not self.pins.get(k) and k != key]  # oldest first
        for old in idle[:max(0, len(self.weights) - MAX_WEIGHTS)]:
            self.op_forget(old)
        return name

    def op_forget(self, key: str, owner: str | None = None) -> dict[str, Any]:
        """Drop the adapters of deleted sampler weights (nothing to do if they were never loaded; once the decodings
        using them end, if any do)."""
        if self.pins.get(key):
            self.forgotten.add(key)
            return {}
        name = self.weights.pop(key, None)
        if name is not None and self.batched is not None:
            self.batched.remove(name)
        return {}

    # ------------------------------------------------------------------ checkpoints

    def _folder(self, model_id: str, kind: str, name: str) -> str:
        from rota_tinker._worker.state_files import private_dir

        tenant = self._get(model_id)[0]
        folder = private_dir(os.path.join(self.spec.data_dir, tenant))
        folder = private_dir(os.path.join(folder, model_id))
        return os.path.join(private_dir(os.path.join(folder, kind)), name)

    def _write(self, model_id: str, path: str, optimizer: bool) -> int:
        from rota_tinker._worker.models import lora_config
        from rota_tinker._worker.state_files import write_adapters

        _, lora, base = self._get(model_id)
        assert self.batched is not None
        leaves = {path.rpartition(".")[2] for path in self.batched.linears}  # its linears are wrapped: name them
        config = lora_config(self.batched.model, lora["rank"], lora["targets"], leaves=leaves)
        opt = self.batched.optimizer_state(model_id) if optimizer else None
        return write_adapters(path, self.batched.state_dict(model_id), config, base, lora, opt)

    def op_save_state(self, model_id: str, name: str, base: Any) -> dict[str, Any]:
        """A training checkpoint (adapters and AdamW state) in ``DATA_DIR/TENANT/MODEL/weights/NAME``."""
        path = self._folder(model_id, "weights", name)
        return {"folder": path, "bytes": self._write(model_id, path, optimizer=True)}

    def op_save_for_sampler(self, model_id: str, name: str, base: Any) -> dict[str, Any]:
        """Sampler weights (the adapters, no optimizer state) in ``DATA_DIR/TENANT/MODEL/sampler_weights/NAME``."""
        path = self._folder(model_id, "sampler_weights", name)
        return {"file": path, "bytes": self._write(model_id, path, optimizer=False), "from_parked": False}

    def op_load_state(self, model_id: str, folder: str, optimizer: bool) -> dict[str, Any]:
        """Load a training checkpoint (a trainer's or this worker's) into the model in place."""
        import torch
        from safetensors.torch import load_file

        self._get(model_id)
        assert self.batched is not None
        try:  # BatchedLora.load refuses adapters of another rank or other targets (shapes, names)
            self.batched.load(model_id, load_file(os.path.join(folder, "adapter_model.safetensors")))
        except (ValueError, FileNotFoundError) as e:
            raise UserError(str(e)) from e
        state = None
        if optimizer:
            state = torch.load(os.path.join(folder, "optimizer.pt"), map_location="cpu", weights_only=True)
        self.batched.load_optimizer_state(model_id, state)
        return {}

