"""The batched LoRA worker: every tenant's LoRA models on one shared base, trained in batched passes.

With ``ServiceConfig.lora_batch`` the service sends the units of LoRA models on a shared base to one
worker process per (base, device) instead of each tenant's trainer. It attaches to the base holder's
copy of the base (:mod:`rota_tinker._worker.holder`) and holds every such model's adapters and AdamW state in
one :class:`rota_tinker._worker.multilora.BatchedLora`. Its loop (:class:`rota_tinker._worker.loop.Loop`) hands
it every ``forward_backward`` and ``optim_step`` unit queued when a turn starts, of any tenant, in
one call (:meth:`BatchTrainer.batch_mixed`):

* each model's units keep their order (round ``k`` takes each model's ``k``-th unit);
* the ``forward_backward`` units of a round run as one batched pass, at most ``tenant_tokens`` tokens
  of one model per pass (:func:`rota_tinker._worker.multilora.plan_batches`: a larger unit is cut by datum
  and runs over consecutive passes; nobody waits more than one pass for its turn in the batch);
* an ``optim_step`` runs that model's own AdamW;
* ``sample`` units (from LoRA sampler weights or the bare base, of any tenant) decode together, each
  row with its own weights' adapters (loaded from their folder on first use, the least recently used
  let go past :data:`MAX_WEIGHTS`).

The worker is one rota tenant (``lora-batch.N``): its batch takes turns against full-parameter
tenants and samplers on the device, like the shared LoRA turn (:mod:`rota_tinker._worker.shared_turn`). Adapters and
Adam state stay on the device for a model's life (a few hundred MB per tenant on a 1.7B base: they
are never parked, like the base). Checkpoints are the trainers' files (peft's adapter files and
``optimizer.pt`` in the same parameter order), so a model moves between this worker and a trainer
either way.
"""

from __future__ import annotations

import gc
import os
from collections import OrderedDict
from typing import Any

from rota_tinker._worker.common import MICRO_BATCH_TOKENS, UserError
from rota_tinker._worker.multilora import BatchedLora, Unit, plan_batches
from rota_tinker._worker.roles import WorkerBase, base_model

__all__ = ["BatchTrainer"]

BATCH_TOKENS = 1 << 20  # tokens of one batched pass, all tenants together (micro-batches bound the memory)
MAX_WEIGHTS = 256  # sampler weights whose adapters stay loaded (least recently used go first)


class BatchTrainer(WorkerBase):
    """The LoRA models of every tenant on one shared base (see the module docs)."""

    DEVICE_OPS = frozenset({"create", "forward_backward", "optim_step", "unload", "save_state", "load_state",
                            "save_for_sampler", "sample", "forget"})
    BATCHED_OPS = frozenset({"forward_backward", "optim_step", "sample"})
    MIXED_BATCHES = True  # the loop hands queued units of all three ops, in arrival order, to batch_mixed
    # a lone unit waits this long for more before its pass starts: the SDK sends a step's optim_step right behind
    # its forward_backward, and without it the optim_step would wait for the whole next pass
    LINGER_S = 0.005

    def __init__(self, spec: Any, gpu: Any) -> None:
        super().__init__(spec, gpu)
        self.batched: BatchedLora | None = None
        self.owners: dict[str, tuple[str, dict[str, Any], Any]] = {}  # model id -> (tenant, lora, base)
        self.weights: OrderedDict[str, str] = OrderedDict()  # sampler weights' folder -> its adapters' name, LRU

    def needs_turn(self, op: str, args: dict[str, Any]) -> bool:
        if op == "unload":
            return args["model_id"] in self.owners
        if op == "forget":
            return args["key"] in self.weights
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

    # ------------------------------------------------------------------ batches

    def batch_mixed(self, units: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any] | Exception]:
        """Run queued ``forward_backward``/``optim_step``/``sample`` units of many tenants (see the module docs);
        each gets its result or the exception that failed it (a bad model id fails only its own units)."""
        out: list[dict[str, Any] | Exception] = [None] * len(units)  # type: ignore[list-item]
        queues: dict[str, list[int]] = {}
        samples = []
        for i, (op, args) in enumerate(units):
            if op == "sample":  # from saved weights: no order with the models' training units
                samples.append(i)
            else:
                queues.setdefault(args["model_id"], []).append(i)
        if samples:
            self._samples([units[i][1] for i in samples], out, samples)
        while any(queues.values()):
            this_round = [q.pop(0) for q in queues.values() if q]
            passes = [i for i in this_round if units[i][0] == "forward_backward"]
            self._forward_backward(units, passes, out)
            for i in this_round:
                if units[i][0] == "optim_step":
                    try:
                        out[i] = self.op_optim_step(**units[i][1])
                    except Exception as e:
                        out[i] = e
        return out

    def _forward_backward(self, units: list[tuple[str, dict[str, Any]]], rows: list[int],
                          out: list[dict[str, Any] | Exception]) -> None:
        """One round's forward_backward units as batched passes; each unit's parts summed back into its result."""
        todo = []
        for i in rows:
            args = units[i][1]
            try:
                self._get(args["model_id"])
            except UserError as e:
                out[i] = e
                continue
            todo.append(Unit(args["model_id"], args["data"], args["loss_fn"], args.get("loss_config"),
                             args["forward_only"], key=i))
        if not todo:
            return
        assert self.batched is not None
        results: dict[int, dict[str, Any]] = {}
        try:
            for batch in plan_batches(todo, self.spec.lora_batch_tokens, BATCH_TOKENS):
                for unit, result in zip(batch, self.batched.forward_backward(batch), strict=True):
                    mine = results.setdefault(unit.key, {"logprobs": [], "metrics": {"loss:sum": 0.0}})
                    mine["logprobs"].extend(result["logprobs"])
                    mine["metrics"]["loss:sum"] += result["metrics"]["loss:sum"]
        except Exception as e:  # a failed pass (out of memory, say) fails every unit in it; as in a trainer
            # process, what its earlier micro-batches added to gradients stays
            for unit in todo:
                out[unit.key] = e
            return
        for key, result in results.items():
            out[key] = result

    # ------------------------------------------------------------------ sampling

    def _samples(self, units: list[dict[str, Any]], out: list[Any], where: list[int]) -> None:
        """Sample units of many tenants (LoRA sampler weights or the bare base) decoded in as few batches as fit,
        each row with its own weights' adapters; unit ``k``'s outcome goes to ``out[where[k]]``."""
        from rota_tinker._worker.sampling import decode_batches

        requests: list[dict[str, Any] | None] = []
        for i, unit in zip(where, units, strict=True):
            try:
                requests.append({**unit, "tenant": self._sampler_weights(unit)})
            except Exception as e:  # weights that cannot load fail their own unit only
                out[i] = e
                requests.append(None)
        ready = [k for k, r in enumerate(requests) if r is not None]
        for part in decode_batches([requests[k] for k in ready], MICRO_BATCH_TOKENS):  # type: ignore[misc]
            batch = [requests[ready[j]] for j in part]
            base = batch[0]["base"]  # type: ignore[index]
            tokenizer = self._tokenizer(base) if any(r["params"].get("stop_strings") for r in batch) else None  # type: ignore[index]
            try:
                assert self.batched is not None
                results: list[Any] = self.batched.sample(batch, base.max_len, tokenizer)  # type: ignore[arg-type]
            except Exception as e:
                results = [e] * len(batch)
            for j, result in zip(part, results, strict=True):
                if isinstance(result, dict):
                    result["timing"] = {"batch_units": float(len(batch)), "decode_rows": float(result.pop("rows"))}
                out[where[ready[j]]] = result

    def _sampler_weights(self, unit: dict[str, Any]) -> str | None:
        """The batch's name of the adapters ``unit`` samples from (loaded from its folder on first use, the least
        recently used let go past :data:`MAX_WEIGHTS`); None for the bare base."""
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
        name = f"weights:{len(self.weights)}:{os.path.basename(key)}"
        while name in batched.adapters:
            name += "'"
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
        while len(self.weights) > MAX_WEIGHTS:
            self.op_forget(next(iter(self.weights)))
        return name

    def op_forget(self, key: str) -> dict[str, Any]:
        """Drop the adapters of deleted sampler weights (nothing to do if they were never loaded)."""
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

