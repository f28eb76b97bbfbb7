"""Shared LoRA bases: one resident copy of a base model per (device, base), handed to tenant workers.

Two sides, both in worker processes (the HTTP process holds no model):

* :class:`BaseHolder` runs in its own process (role ``base`` of :mod:`rota_tinker._worker.main`),
  one per (device, base model) that a LoRA tenant uses. It builds the base once, packs
  every weight into **one flat tensor** (CPU: POSIX shared memory; CUDA: one device
  allocation), and serves it on a Unix socket: each connecting worker receives the flat
  tensor through ``torch.multiprocessing``'s reductions (an fd of the shared-memory file
  on CPU, a CUDA IPC handle on CUDA) plus the layout (name -> offset, shape).
* :func:`attach` runs in a tenant's trainer or sampler: it fetches the flat tensor once
  per base and builds the model's modules on ``meta``, then points every base parameter
  at a view of the shared tensor. Nothing is copied; all tenants read the same bytes.

Invariants: the base is **read-only** for tenants (its parameters have
``requires_grad=False``, no optimizer sees them, :func:`attach`'s callers never call
``rota_fsdp.track`` on the base: only adapters and their optimizer state are parked);
the holder's memory is resident like a CUDA context and never parked (with
``lora_concurrency`` > 1 the holder is also the rota tenant of its shared LoRA turn,
:mod:`rota_tinker._worker.shared_turn`, which only takes turns); and it must outlive its
consumers (the service stops tenant workers before holders, and waits for them: a consumer of
a CUDA IPC handle must not outlive the producer, and a consumer drops its references (:func:`detach_all`) before it
exits so the producer sees every shared tensor released).
:meth:`BaseHolder.op_info` gives a checksum so tests can show the bytes never change.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from multiprocessing import current_process
from multiprocessing.connection import Client, Listener
from typing import Any

log = logging.getLogger("rota_tinker.base")

ALIGN = 256  # bytes: each tensor starts 256-byte aligned in the flat byte tensor, like the caching allocator's blocks
Layout = dict[str, tuple[int, tuple[int, ...], str]]  # name -> (byte offset, shape, dtype name)
_attached: dict[tuple[str, str], tuple[Any, Layout]] = {}
_attach_lock = threading.Lock()


def tensor_layout(model: Any) -> tuple[Layout, dict[int, Any]]:
    """Where each parameter and buffer of ``model`` goes in one flat byte tensor; tied tensors share a place.

    Non-persistent buffers (rotary frequencies) are included: a model built on ``meta`` has none of them.
    """
    layout: Layout = {}
    tensors: dict[int, Any] = {}  # byte offset -> the tensor stored there
    seen: dict[int, int] = {}
    total = 0
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if id(t) in seen:
            off = seen[id(t)]
        else:
            off = seen[id(t)] = total
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
            tensors[off] = t
        layout[name] = (off, tuple(t.shape), str(t.dtype).removeprefix("torch."))
    return layout, tensors


def segment_of(address: int) -> dict[str, Any] | None:
    """The mapping of ``/proc/self/maps`` holding ``address``: path, inode, start, end (CPU tensors only)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return {"path": parts[5].strip() if len(parts) > 5 else "", "inode": int(parts[4]), "start": lo,
                        "end": hi}
    return None


class BaseHolder:
    """The process that owns one base model's weights and shares them (see the module docstring)."""

    def __init__(self, spec: Any) -> None:
        import torch
        import torch.multiprocessing  # registers the tensor reductions that Connection.send uses

        from rota_tinker._worker.models import build_base

        self.spec, self.base = spec, spec.base
        self.device = torch.device(spec.device)
        model = build_base(self.base, self.device)  # a function of the base's seed (or its files) on this device
        self.layout, tensors = tensor_layout(model)
        total = max((off + t.numel() * t.element_size() for off, t in tensors.items()), default=0)
        self.flat = torch.zeros(total, dtype=torch.uint8, device=self.device)
        if self.device.type == "cpu":
            self.flat.share_memory_()
        for off, t in tensors.items():
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            self.flat[off:off + raw.numel()].copy_(raw)
        del model, tensors
        if self.device.type == "cuda":  # the built model's blocks go back to the driver: only the flat copy stays
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.checksum = self._checksum()
        self.listener = Listener(family="AF_UNIX", authkey=current_process().authkey)
        self.gpu, self.gate = None, None
        if spec.lora_concurrency > 1:  # LoRA trainers on this base run in one rota turn, several at once
            import rota
            from rota_tinker._worker.shared_turn import SharedTurnGate

            self.gpu = rota.connect(group=spec.group, tenant=spec.shared_turn_job, endpoint=spec.endpoint)
            self.gate = SharedTurnGate(self.gpu, spec.lora_concurrency)
        threading.Thread(target=self._serve, name="rota-tinker-base-share", daemon=True).start()
        log.info("base %s on %s: %.1f MiB shared at %s", self.base.name, self.device, self.nbytes / 2**20,
                 self.listener.address)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def hello(self) -> dict[str, Any]:
        """What the HTTP process learns at start: where to fetch the base, and its size."""
        return {"address": self.listener.address, "bytes": self.nbytes}

    def _checksum(self) -> str:
        return hashlib.sha256(self.flat.detach().cpu().numpy().tobytes()).hexdigest()

    def _serve(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            # one thread per consumer: a slow one (unpickling, CUDA start) must not hold up the others
            threading.Thread(target=self._hand_over, args=(conn,), name="rota-tinker-base-send", daemon=True).start()

    def _hand_over(self, conn: Any) -> None:
        """Send the flat tensor and layout to one consumer; wait for its ack (it then holds its own reference)."""
        try:
            want = conn.recv()
            if want == ("gate",) and self.gate is not None:  # a LoRA worker's side of the shared turn
                self.gate.serve(conn)
                return
            if want != ("base", self.base.name):
                conn.send(("err", f"this holder serves base {self.base.name!r}, not {want!r}"))
            else:
                conn.send(("ok", self.flat, self.layout))
                conn.recv()  # the consumer's ack: it holds its own reference now
        except (EOFError, OSError) as e:
            log.warning("a worker went away while fetching base %s: %s", self.base.name, e)
        finally:
            conn.close()

    def close(self) -> None:
        """Stop serving and free the base (the service closes holders after every consumer has exited)."""
        import torch

        self.listener.close()
        if self.gate is not None:
            self.gate.close()
            self.gpu.close()
        del self.flat
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.ipc_collect()

    def op_info(self, checksum: bool = False) -> dict[str, Any]:
        """Size, device, the shared segment (CPU) and, on request, whether the bytes still match."""
        out: dict[str, Any] = {"base": self.base.name, "device": str(self.device), "bytes": self.nbytes,
                               "address": self.listener.address}
        if self.device.type == "cpu":
            out["segment"] = segment_of(self.flat.data_ptr())
        if checksum:
            out["checksum"] = self._checksum()
            out["unchanged"] = out["checksum"] == self.checksum
        return out


def attach(base: Any, device: Any, address: str) -> Any:
    """A model of ``base`` whose weights are views of the holder's shared tensor (fetched once per process)."""
    import torch
    import torch.multiprocessing  # registers the tensor reductions that Connection.recv uses
    from torch import nn

    from rota_tinker._worker.models import meta_model

    key = (base.name, str(device))
    want = torch.device(device)
    if want.type == "cuda":  # start CUDA here, not while unpickling the handle (the holder waits for our ack)
        torch.cuda.init()
    with _attach_lock:
        if key not in _attached:
            conn = Client(address, family="AF_UNIX", authkey=current_process().authkey)
            try:
                conn.send(("base", base.name))
                reply = conn.recv()
                if reply[0] != "ok":
                    raise RuntimeError(f"base holder at {address}: {reply[1]}")
                conn.send("ack")
            finally:
                conn.close()
            flat, layout = reply[1], reply[2]
            if flat.device.type != want.type or (want.index is not None and flat.device.index != want.index):
                raise RuntimeError(f"base {base.name!r} is held on {flat.device}, this worker runs on {device}")
            _attached[key] = (flat, layout)
        flat, layout = _attached[key]
    model = meta_model(base)
    for name, (off, shape, dtype) in layout.items():
        owner, _, leaf = name.rpartition(".")
        kind = getattr(torch, dtype)
        numel = 1
        for dim in shape:
            numel *= dim
        view = flat[off:off + numel * kind.itemsize].view(kind).view(shape)
        module = model.get_submodule(owner)
        if leaf in module._buffers:
            module._buffers[leaf] = view
        else:
            module._parameters[leaf] = nn.Parameter(view, requires_grad=False)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"base {base.name!r} from {address} lacks {left[:4]}: holder and worker disagree on it")
    return model


def detach_all() -> None:
    """Forget every attached base (a worker calls it on exit, after dropping its models)."""
    with _attach_lock:
        _attached.clear()


def shared_flat(base: Any, device: Any) -> Any:
    """The flat shared tensor this process attached for ``base`` (tests and reports only)."""
    return _attached[(base.name, str(device))][0]
