"""What a park left on the device, by name: live tensors rota does not track, and memory
outside torch's allocator.

Why: a park that leaves gigabytes behind is a fault, and "2112 MiB allocated" does not
tell the user what to track or free. :func:`name_untracked` finds the live tensors on
the device whose storage no adapter tracks and names each by who holds it (a module
attribute, an object's attribute, a named-tuple field), so the message can say e.g.
``FSDPCommContext.reduce_scatter_state.reduce_scatter_input``. It walks every
Python object (``gc``), so adapters call it only when the allocator holds much more
than the named residue, i.e. on the way to a fault.

:func:`outside_allocator_bytes` reads NVML's per-process bytes on the device and takes
away what torch's allocator reserves (:mod:`rota.nvml`): the CUDA context, NCCL's
communicators and buffers, library handles. Those cannot be parked (communicators stay alive across
parks, so a turn never re-initialises them) and are reported as their own category,
not counted against ``ROTA_RESIDUE_MAX_BYTES``. Needs ``nvidia-ml-py``; without it,
or without a GPU, it returns None.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterable, Mapping

import torch

from rota.nvml import device_process_bytes

log = logging.getLogger(__name__)

MAX_NAMED = 16  # storages named per park; the largest first
_DEPTH = 3  # referrer levels followed to name a tensor


def _allocator_ranges(device: torch.device) -> list[tuple[int, int]] | None:
    """(start, end) of every segment this process's CUDA caching allocator holds on ``device``; None off CUDA.

    Why: a tensor received from another process (CUDA IPC, e.g. a shared base model) lives in memory that
    process allocated; parking this one cannot free it, and NVML counts it there, not here.
    """
    if device.type != "cuda":
        return None
    return [(seg["address"], seg["address"] + seg["total_size"]) for seg in torch.cuda.memory_snapshot()
            if seg.get("device") == device.index]


def _owned(ptr: int, ranges: list[tuple[int, int]] | None) -> bool:
    return ranges is None or any(lo <= ptr < hi for lo, hi in ranges)


def _device_tensors(device: torch.device, skip: set[int]) -> dict[int, tuple[int, list[torch.Tensor]]]:
    """storage key -> (bytes, tensors) of every live tensor on ``device`` whose storage is not in ``skip``
    and, on CUDA, lives in this process's own allocator (not a CUDA IPC import)."""
    out: dict[int, tuple[int, list[torch.Tensor]]] = {}
    ranges = _allocator_ranges(device)
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(), not isinstance: proxies warn on __class__
            continue
        try:
            t = getattr(obj, "_local_tensor", None)
            t = t if isinstance(t, torch.Tensor) else obj
            if t.device != device or t.is_meta or t.layout != torch.strided:
                continue
            s = t.untyped_storage()
            key, nbytes, ptr = s._cdata, s.nbytes(), s.data_ptr()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            continue
        if nbytes == 0 or key in skip or not _owned(ptr, ranges):
            continue
        entry = out.setdefault(key, (nbytes, []))
        entry[1].append(obj)
    return out


def _owner_of_dict(d: dict, ignore: set[int]) -> object | None:
    for ref in gc.get_referrers(d):
        if id(ref) not in ignore and getattr(ref, "__dict__", None) is d:
            return ref
    return None


def _name(obj: object, ignore: set[int], depth: int) -> str:
    """Who holds ``obj``: ``Type.attr``, ``Type.attr.field`` or ``Type.attr[i]``, up to ``depth`` levels."""
    if depth == 0:
        return ""
    for ref in gc.get_referrers(obj):
        if id(ref) in ignore:
            continue
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is obj), None)
            if not isinstance(key, str):
                continue
            owner = _owner_of_dict(ref, ignore | {id(ref)})
            if owner is not None:
                return f"{type(owner).__name__}.{key}"
            up = _name(ref, ignore | {id(ref)}, depth - 1)  # e.g. a module's _parameters or _buffers
            if up:
                return f"{up}[{key!r}]"
        elif isinstance(ref, tuple) and hasattr(ref, "_fields"):  # a named tuple
            field = next((f for f, v in zip(ref._fields, ref, strict=False) if v is obj), "?")
            up = _name(ref, ignore | {id(ref)}, depth - 1)
            return f"{up or type(ref).__name__}.{field}"
        elif isinstance(ref, (list, tuple)):
            index = next((i for i, v in enumerate(ref) if v is obj), None)
            up = _name(ref, ignore | {id(ref)}, depth - 1)
            if up:
                return f"{up}[{index}]"
        elif isinstance(getattr(ref, "__dict__", None), dict) and not isinstance(ref, type):
            # Python >= 3.11 keeps most attributes inline: the object itself refers to the value
            key = next((k for k, v in vars(ref).items() if v is obj), None)
            if isinstance(key, str):
                return f"{type(ref).__name__}.{key}"
    return ""


def name_untracked(device: torch.device | str, tracked: Iterable[int], *,
                   known: Mapping[int, str] | None = None, limit: int = MAX_NAMED) -> dict[str, int]:
    """``untracked:NAME`` -> device bytes of the live tensors on ``device`` that rota does not park.

    :param tracked: storage keys (``untyped_storage()._cdata``) adapters park: skipped.
    :param known: storage key -> a better name the adapter knows (e.g. ``layers.0.cache``
        for a module attribute, ``fsdp:layers.0.weight`` for an unsharded parameter).
    :param limit: at most this many storages are named (the largest); the rest are
        summed under ``untracked:(N more tensors)``.

    Tensors no Python object refers to (e.g. saved by an autograd graph that was never
    run backward) cannot be named; they show only in the allocator's total.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    known = dict(known or {})
    found = _device_tensors(device, set(tracked))
    ranked = sorted(found.items(), key=lambda kv: -kv[1][0])
    out: dict[str, int] = {}
    ignore = {id(found), id(ranked)}
    for key, (nbytes, tensors) in ranked[:limit]:
        ignore |= {id(found[key]), id(found[key][1])}
        # a storage is reported once, by its owner: the tensor spanning it (a flat buffer, not one of its views)
        owners = [t for t in tensors if t.storage_offset() == 0 and t.numel() * t.element_size() == nbytes]
        t = owners[0] if owners else tensors[0]
        name = known.get(key) or next((n for x in owners if (n := _name(x, ignore, _DEPTH))), "")
        if not name:  # the owner is held by nothing with a name (a cache, a dict entry): name a view of it
            view = next((n for x in tensors if (n := _name(x, ignore, _DEPTH))), "")
            name = f"{view} (a view; {len(tensors)} tensors share this buffer)" if view and len(tensors) > 1 else view
        label = f"untracked:{name or 'unreferenced tensor'} ({str(t.dtype).removeprefix('torch.')}" \
                f"{list(t.shape)})"
        out[label] = out.get(label, 0) + nbytes
    rest = ranked[limit:]
    if rest:
        out[f"untracked:({len(rest)} more tensors)"] = sum(n for _, (n, _) in rest)
    return out


def collect_if_over(held: int, named: int, limit: int) -> bool:
    """Run the cycle collector when the allocator's ``held`` bytes, beyond the ``named`` residue, would fail the
    park (over ``limit``, ``ROTA_RESIDUE_MAX_BYTES``); whether it ran.

    Why: a model deleted without ``gc.collect()`` whose objects form reference cycles (an FSDP2 model and its
    hooks do) keeps its device memory until the collector next runs. That is garbage, not residue: on an H100 the
    CUDA tier's FSDP2 test failed its park on the 1 GiB of a reference model it had deleted just before.
    Only on the way to a fault: a full collection walks every Python object.
    """
    if limit <= 0 or held <= limit or held <= named:
        return False
    gc.collect()
    return True


def give_back_workspaces(device: torch.device) -> None:
    """After the tenant's last model parked: drop cuBLAS's cached workspaces (made again at the next matmul) and
    hand every free segment back to the driver.

    Why: a workspace is a live block of the caching allocator; carved out of a freed activation block, it keeps
    that whole segment (hundreds of MiB) from going back, although nothing else in it is used.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        torch.cuda.synchronize(device)
        clear()
    torch.cuda.empty_cache()


def fragmentation(device: torch.device) -> dict[str, int]:
    """``process:fragmented``: bytes the allocator keeps only because a live block shares their segment (after
    ``empty_cache``); above 64 MiB the live blocks that pin them are logged, largest first."""
    held = int(torch.cuda.memory_reserved(device)) - int(torch.cuda.memory_allocated(device))
    if held > 64 << 20:
        pins = sorted(((b["size"], seg["total_size"]) for seg in torch.cuda.memory_snapshot()
                       if seg.get("device") == device.index and seg["allocated_size"] < seg["total_size"]
                       for b in seg["blocks"] if b["state"] == "active_allocated"), reverse=True)
        log.warning("after a park %.1f MiB stay reserved in segments pinned by live blocks (block, segment MiB): %s",
                    held / 2**20, [(round(b / 2**20, 2), round(t / 2**20, 1)) for b, t in pins[:12]])
    return {"process:fragmented": max(0, held)}


def process_device_bytes(device: torch.device | str, pid: int | None = None) -> int | None:
    """Bytes NVML says process ``pid`` (default: this one) uses on ``device``; None without NVML."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        nvml_index = torch.cuda._get_nvml_device_index(index)  # honours CUDA_VISIBLE_DEVICES
    except Exception:
        return None
    return device_process_bytes(nvml_index, os.getpid() if pid is None else pid)


def outside_allocator_bytes(device: torch.device | str) -> int | None:
    """This process's device bytes outside torch's caching allocator (context, NCCL, handles); None if unknown."""
    used = process_device_bytes(device)
    if used is None:
        return None
    return max(0, used - int(torch.cuda.memory_reserved(torch.device(device))))


__all__ = ["fragmentation", "give_back_workspaces", "name_untracked", "outside_allocator_bytes",
           "process_device_bytes"]
