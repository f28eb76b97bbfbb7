"""A vLLM engine's sleep and wake done by hand, allocation by allocation, to see whether a restore can keep to 1.2x
the pinned floor (issue 41): a probe for ``bench/vllm_switch.py`` (``--pipelined``), not a rota code path.

Why: rota's park through vLLM's sleep mode is a copy at the floor and then ``sleep(level=2)``, which unmaps every
allocation of vLLM's pool (0.046 s at the 4B shape on an H100, 0.3x the floor) after the last byte moved; its
restore is ``wake_up(tags=["weights"])``, which maps every weights allocation (0.032 s) before the first byte
moves, then the copies (into memory just mapped, slower than the floor at first). Here the same work overlaps:

* park: the weights' copies into a pinned pool are issued on a side stream, the other allocations (the KV cache)
  are unmapped while they run, and the weights' own allocations after the copies are done;
* restore: each weights allocation is mapped and its tensors' copies issued at once, so the copy engines work while
  the next allocation is mapped; then the KV cache is mapped while the copies run.

The tensors moved are the model's parameters and buffers (what vLLM's level 2 keeps or reloads), each copied
where it lives, i.e. inside the allocation it belongs to. It drives ``vllm.device_allocator.cumem``'s allocator
directly (``CuMemAllocator.pointer_to_data``, ``create_and_map``, ``unmap_and_release``: vLLM 0.26.0), bypassing
``LLM.sleep``: the caller resets the prefix cache after the park (its KV blocks are gone) and checks the tokens.
Each function runs inside the vLLM worker through ``LLM.collective_rpc`` (the engine in this process).
"""

from __future__ import annotations

import time
from typing import Any

import torch

ATTR = "_rota_bench_pipelined"


class Pipelined:
    """The worker's model tensors grouped by the sleep pool's allocation that holds them, and a pinned pool."""

    def __init__(self, worker: Any) -> None:
        from vllm.device_allocator.cumem import CuMemAllocator

        from rota_torch import HostPool, align

        self.allocator = CuMemAllocator.get_instance()
        items = sorted(self.allocator.pointer_to_data.items())
        self.weights = [(ptr, data) for ptr, data in items if data.tag == "weights"]
        self.others = [(ptr, data) for ptr, data in items if data.tag != "weights"]
        model = worker.model_runner.get_model()
        storages: dict[int, torch.UntypedStorage] = {}
        for t in [*model.parameters(), *model.buffers()]:
            s = t.detach().untyped_storage()
            if s.nbytes():
                storages.setdefault(s.data_ptr(), s)
        # each storage under the weights allocation that holds it (address order), at its offset in the pool
        self.groups: list[list[tuple[torch.Tensor, int]]] = [[] for _ in self.weights]
        total, outside = 0, 0
        for ptr, s in sorted(storages.items()):
            k = next((i for i, (start, data) in enumerate(self.weights) if start <= ptr < start + data.handle[1]),
                     None)
            if k is None:
                outside += s.nbytes()  # not in the sleep pool: stays on the device, as with vLLM's own sleep
                continue
            self.groups[k].append((torch.empty(0, dtype=torch.uint8, device=s.device).set_(s), total))
            total += align(s.nbytes())
        self.nbytes = sum(d.numel() for group in self.groups for d, _ in group)
        self.outside_bytes = outside
        self.pool = HostPool(pin=True)
        self.pool.reserve(total)
        self.stream = torch.cuda.Stream()

    def park(self) -> dict[str, float]:
        from vllm.device_allocator.cumem import unmap_and_release

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for group in self.groups:
                for dev, offset in group:
                    self.pool.transfer(dev, offset, to_host=True, non_blocking=True)
        t1 = time.perf_counter()
        for _ptr, data in self.others:  # the KV cache, while the weights' copies run
            unmap_and_release(data.handle)
            data.is_asleep = True
        t2 = time.perf_counter()
        self.stream.synchronize()
        t3 = time.perf_counter()
        for _ptr, data in self.weights:
            unmap_and_release(data.handle)
            data.is_asleep = True
        t4 = time.perf_counter()
        return {"park_s": t4 - t0, "issue_s": t1 - t0, "unmap_others_s": t2 - t1, "wait_s": t3 - t2,
                "unmap_weights_s": t4 - t3}

    def restore(self, worker: Any) -> dict[str, float]:
        from vllm.device_allocator.cumem import create_and_map

        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            for (_ptr, data), group in zip(self.weights, self.groups, strict=True):
                create_and_map(data.handle)
                data.is_asleep = False
                for dev, offset in group:
                    self.pool.transfer(dev, offset, to_host=False, non_blocking=True)
        t1 = time.perf_counter()
        for _ptr, data in self.others:  # mapped while the copies run
            create_and_map(data.handle)
            data.is_asleep = False
        t2 = time.perf_counter()
        self.stream.synchronize()
        torch.cuda.current_stream().wait_stream(self.stream)
        t3 = time.perf_counter()
        worker.model_runner.post_kv_cache_wake_up()  # what vLLM's own wake of the KV cache does after mapping it
        t4 = time.perf_counter()
        return {"restore_s": t4 - t0, "map_weights_and_issue_s": t1 - t0, "map_others_s": t2 - t1,
                "wait_s": t3 - t2, "after_s": t4 - t3}


def prepare_on_worker(worker: Any) -> dict[str, int]:
    """Group the tensors and pin the pool (once); bytes moved by each park, and bytes left outside the pool."""
    state = getattr(worker, ATTR, None)
    if state is None:
        state = Pipelined(worker)
        setattr(worker, ATTR, state)
    return {"bytes": state.nbytes, "outside_pool_bytes": state.outside_bytes,
            "weights_allocations": len(state.weights), "other_allocations": len(state.others)}


def park_on_worker(worker: Any) -> dict[str, float]:
    return getattr(worker, ATTR).park()


def restore_on_worker(worker: Any) -> dict[str, float]:
    return getattr(worker, ATTR).restore(worker)


def drop_on_worker(worker: Any) -> None:
    if hasattr(worker, ATTR):
        delattr(worker, ATTR)


def probe(llm: Any, cycles: int, check: Any, nvml: Any) -> dict[str, Any]:
    """``cycles`` by-hand parks and restores of an engine rota does not track; after each park the prefix cache is
    reset (its KV blocks were dropped) and NVML of this process read; after each restore the tokens checked."""
    info = llm.collective_rpc(prepare_on_worker)[0]
    parks, restores, nvml_after = [], [], []
    try:
        for i in range(cycles):
            parks.append(llm.collective_rpc(park_on_worker)[0])
            llm.reset_prefix_cache()
            nvml_after.append(nvml())
            restores.append(llm.collective_rpc(restore_on_worker)[0])
            check("the pipelined probe's restore", "pipelined", i)
    finally:
        llm.collective_rpc(drop_on_worker)
    return {**info, "park": parks, "restore": restores, "nvml_after_park": nvml_after}
