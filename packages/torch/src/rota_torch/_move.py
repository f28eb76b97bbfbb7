"""Moving a parker's tensors to another device of the host: a turn granted on another GPU.

Who calls it: :meth:`rota_torch.Tracked.restore` when ``ParkPlan.device`` names another
device than the model's (a group over several GPUs, see ``rota.devices``).

* **Parked**: each parked storage is re-created, empty, on the new device and every tracked
  tensor is re-pointed at it; the parker's usual restore then copies host -> new device
  (the same checks, staging and rollback as any restore).
* **Resident**: each distinct storage is copied device to device (a peer copy, over
  NVLink where the GPUs have it; never through host memory), the host waits once, then
  every tracked tensor is re-pointed and the old storages are freed and handed back to
  the driver: nothing of the model stays on the old device.

Tensors keep their Python identities (``param.data`` changes, not ``param``), so the
optimizer, hooks and views through tracked tensors stay valid; tensors that shared a
storage share the new one. What the process keeps per device moves too: the CUDA RNG
state of the old device is carried to the new one (dropout draws the same numbers), and
the new device becomes the current one. Streams are per device: the parker's side stream
is made again on the new device.
"""

from __future__ import annotations

import time

import torch

from rota.types import ParkResult
from rota_torch._parker import TensorParker


def _repoint(parker: TensorParker, new: dict[int, torch.UntypedStorage], target: torch.device) -> None:
    """Every tracked tensor on a storage of ``new``'s keys now views the new storage (same offset, shape, strides)."""
    seen: set[int] = set()
    with torch.no_grad():
        for _, _, t in list(parker.named_tensors()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            storage = new.get(t.untyped_storage()._cdata)
            if storage is None:
                continue
            view = torch.empty(0, dtype=t.dtype, device=target)
            view.set_(storage, t.storage_offset(), t.size(), t.stride())
            t.data = view


def _carry_device_state(source: torch.device, target: torch.device) -> None:
    """The CUDA RNG state and the current device follow the model."""
    if source.type != "cuda" or target.type != "cuda":
        return
    torch.cuda.set_rng_state(torch.cuda.get_rng_state(source), target)
    if torch.cuda.current_device() == source.index:
        torch.cuda.set_device(target)


def rehome_parked(parker: TensorParker, target: torch.device) -> None:
    """A parked parker's storages are re-created, empty, on ``target``; its next restore lands there."""
    with parker.lock:
        if not parker.parked:
            raise RuntimeError(f"parker {parker.name!r} is not parked; move it with move_resident")
        source = parker.device
        new: dict[int, torch.UntypedStorage] = {}
        for key, slot in parker._slots.items():
            # set_ checks the storage is large enough for the view: allocated full, emptied after re-pointing
            new[key] = torch.UntypedStorage(slot.nbytes, device=target)
        _repoint(parker, new, target)
        slots = {}
        for key, slot in parker._slots.items():
            new[key].resize_(0)
            slot.storage = new[key]
            slots[new[key]._cdata] = slot
        parker._slots = slots
        parker.device, parker._stream = target, None
        _carry_device_state(source, target)
        if source.type == "cuda":
            with torch.cuda.device(source):
                torch.cuda.empty_cache()


def _peer_copy(found: dict[int, tuple[torch.UntypedStorage, str, str]], new: dict[int, torch.UntypedStorage],
               source: torch.device, target: torch.device) -> None:
    """Issue every storage's device-to-device copy (after the source's pending work), then wait once."""
    if source.type == "cuda":
        torch.cuda.current_stream(target).wait_stream(torch.cuda.current_stream(source))
    for key, (storage, _, _) in found.items():
        if storage.nbytes():
            dst = torch.empty(0, dtype=torch.uint8, device=target).set_(new[key])
            dst.copy_(torch.empty(0, dtype=torch.uint8, device=source).set_(storage), non_blocking=True)
    if source.type == "cuda":  # the host waits once, for both ends of the copies
        torch.cuda.synchronize(target)
        torch.cuda.synchronize(source)


def move_resident(parker: TensorParker, target: torch.device) -> ParkResult:
    """Copy a resident parker's storages to ``target`` device to device, re-point its tensors, free the old ones."""
    t0 = time.perf_counter()
    with parker.lock:
        if parker.parked:
            raise RuntimeError(f"parker {parker.name!r} is parked; rehome it with rehome_parked, then restore")
        source = parker.device
        found = parker.storages()
        new: dict[int, torch.UntypedStorage] = {}
        by_tag: dict[str, int] = {}
        for key, (storage, tag, _) in found.items():
            n = storage.nbytes()
            new[key] = torch.UntypedStorage(n, device=target)
            by_tag[tag] = by_tag.get(tag, 0) + n
        _peer_copy(found, new, source, target)
        found.clear()  # no reference to an old storage is left here: re-pointing frees them
        _repoint(parker, new, target)
        parker.device, parker._stream = target, None
        _carry_device_state(source, target)
        if source.type == "cuda" and parker.release_cached:
            with torch.cuda.device(source):
                torch.cuda.empty_cache()
        moved = sum(by_tag.values())
    return ParkResult(bytes_moved=moved, by_tag=by_tag, seconds=time.perf_counter() - t0,
                      host_bytes=parker.pool.capacity, spilled_bytes=parker.pool.spilled_bytes)
