"""The Tinker service on a real GPU, as a user runs it: a Qwen3-shaped Hugging Face snapshot (random bf16 weights
written with ``save_pretrained`` in the hub-cache layout, tied embeddings, a local tokenizer), two API keys that
each train a full-parameter and a LoRA client through the tinker SDK at ``capacity 0`` (every switch parks):
trainers holding a full model and LoRA adapters, and samplers holding sampler weights.

Every park of every worker gives the device back (NVML of the worker: its CUDA context plus at most 256 MiB),
none fails, the losses of the two tenants equal each other and a run with no parks (bit for bit), a
``load_state`` and sampler weights work after parks, and the shared base's holder keeps one copy of the base.
``ROTA_CUDA_TIER_SHAPE`` picks the Qwen3 shape (default ``qwen3-0.6b``; ``qwen3-1.7b`` is the issue's).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

MIB = 1 << 20
LIMIT = 256 * MIB
SHAPE = os.environ.get("ROTA_CUDA_TIER_SHAPE", "qwen3-0.6b")
BASE = "acme/Qwen3-tier"
KEYS = {  # 128 random bits and more: the service refuses guessable keys
    "alice": "tml-0Dt0J-oo49QLSQlEgOzl2hD0drCZCBqGQLnwhzlJkH0",
    "bob": "tml-wm6zbsYFmKHj5alrE_pJsmKH3YLsDGdNHOuN7H3gRUs",
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rota_tinker.testing import QWEN3_SHAPES, hub_cache_snapshot

    root = tmp_path_factory.mktemp("hub")
    dims = {"tie": True, **QWEN3_SHAPES[SHAPE], "max_position_embeddings": 4096}  # 8B names its own tie
    hub_cache_snapshot(root, BASE, dtype="bfloat16", **dims)
    return root


@pytest.fixture(scope="module")
def data() -> list[Any]:
    import numpy as np
    from tinker import types

    rng = np.random.default_rng(7)
    out = []
    for _ in range(4):
        toks = rng.integers(0, 1000, size=129)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": toks[1:].astype(np.int64),
                                               "weights": np.ones(128, dtype=np.float32)}))
    return out


def _service(cache: Path, tmp: Path, capacity: int, tenants: list[str], device: str = "cuda:0") -> Any:
    from rota_tinker import ServiceConfig, Tenant, TinkerService, find_models

    cfg = ServiceConfig(tenants=tuple(Tenant(t, KEYS[t]) for t in tenants), data_dir=str(tmp), device=device,
                        long_poll_s=5.0, base_models=find_models([str(cache)]), model_dirs=(str(cache),),
                        capacity_bytes=capacity, deterministic=True, max_bytes=2**50, worker_start_timeout_s=600.0)
    return TinkerService(cfg)


def _script(svc: Any, tenants: list[str], data: list[Any]) -> dict[str, Any]:
    """Each tenant: a full and a LoRA client; 4 steps interleaved tenant by tenant (A, B, A, B: every switch parks
    at capacity 0), a save_state after step 2 and a load_state of it before step 4 (so step 4 repeats step 3),
    then sampler weights of both and a seeded sample from each."""
    import tinker
    from tinker import types

    from rota_tinker.testing import full_training_client

    sc = {t: tinker.ServiceClient(base_url=svc.url, api_key=KEYS[t]) for t in tenants}
    tcs = {(t, k): (full_training_client(sc[t], BASE, timeout_s=600) if k == "full" else
                    sc[t].create_lora_training_client(base_model=BASE, rank=16, seed=3).result(600))
           for t in tenants for k in ("full", "lora")}
    losses: dict[str, list[float]] = {f"{t}.{k}": [] for t, k in tcs}
    saved: dict[tuple[str, str], str] = {}
    for step in range(4):
        for (t, k), tc in tcs.items():
            if step == 3:
                tc.load_state_with_optimizer(saved[(t, k)]).result(600)
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(600)
            losses[f"{t}.{k}"].append(fb.result(600).metrics["loss:sum"])
            if step == 1:
                saved[(t, k)] = tc.save_state(f"step2-{k}").result(600).path
    samples: dict[str, list[int]] = {}
    prompt = types.ModelInput.from_ints(list(range(5, 21)))
    samplers = {(t, k): tc.save_weights_and_get_sampling_client(name=f"final-{k}") for (t, k), tc in tcs.items()}
    for _ in range(2):  # twice round: each sampler is parked by the next tenant's and restored for its second
        for (t, k), sampler in samplers.items():
            out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=11, temperature=1.0)).result(600)
            got = list(out.sequences[0].tokens)
            assert samples.setdefault(f"{t}.{k}", got) == got, f"{t}.{k}: a restored sampler sampled otherwise"
    for c in sc.values():
        c.close("success").result(30)
    return {"losses": losses, "samples": samples}


def _holder_bytes(svc: Any) -> dict[str, int]:
    from rota_torch import process_device_bytes

    return {name: process_device_bytes("cuda:0", h.pid) or 0 for name, h in svc.state.holders.items() if h.pid}


def both_runs(cache: Path, data: list[Any], tmp: Callable[[str], Path], device: str = "cuda:0") -> dict[str, Any]:
    """The two tenants at capacity 0 (every switch parks) and, at the same time in a service of its own, alice
    alone with room for everything (no parks): her losses and samples there are what the parks must not change.
    Side by side, not one after the other: on the H100 they took 129 s and 70 s, the tier's largest test. Each
    service has its own processes, and every figure asserted is per process (NVML of a worker's pid)."""
    out: dict[str, Any] = {"seconds": {}, "worker_starts": {}}  # where the tier's largest test spends its time

    def alone() -> None:
        t0 = time.monotonic()
        with _service(cache, tmp("resident"), 120 << 30, ["alice"], device) as svc:
            out["alone"] = _script(svc, ["alice"], data)
            out["worker_starts"]["alone"] = svc.worker_starts()
        out["seconds"]["alone"] = time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tinker-alone") as pool:
        beside = pool.submit(alone)
        t0 = time.monotonic()
        with _service(cache, tmp("parks"), 0, ["alice", "bob"], device) as svc:
            out["parks"] = _script(svc, ["alice", "bob"], data)
            out["units"] = svc.unit_timings()
            out["holders"] = _holder_bytes(svc)
            out["base_bytes"] = svc.state.config.base_models[BASE].params() * 2
            out["worker_starts"]["parks"] = svc.worker_starts()
        out["seconds"]["parks"] = time.monotonic() - t0
        beside.result()
    return out


@pytest.fixture(scope="module")
def runs(cache: Path, data: list[Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    yield both_runs(cache, data, tmp_path_factory.mktemp)


def test_two_tenants_full_and_lora_at_capacity_0_park_every_switch_and_free_the_device(runs: dict[str, Any],
                                                                                      record: Any) -> None:
    units = runs["units"]
    failed = [u for u in units if u["failed"]]
    parks = [u for u in units if u.get("parked_bytes")]
    legs: dict[str, dict[str, float]] = {}  # per unit kind, each leg's seconds summed: where the run's time goes
    for u in units:
        kind = legs.setdefault(u["kind"], {"units": 0.0})
        kind["units"] += 1
        for leg, value in u.items():
            if leg.endswith("_s"):
                kind[leg] = round(kind.get(leg, 0.0) + value, 3)
    record(shape=SHAPE, units=len(units), failed_units=len(failed), run_seconds=runs["seconds"],
           worker_starts=runs["worker_starts"], unit_seconds_by_kind=legs, parks=[
        {k: u.get(k) for k in ("tenant", "kind", "parked_bytes", "parked_s", "parked_nvml_before",
                               "parked_nvml_after", "parked_outside_allocator", "parked_residue")} for u in parks])
    assert not failed, f"{len(failed)} units failed: {failed[:3]}"
    by_worker = {}
    for u in parks:
        by_worker[u["tenant"]] = by_worker.get(u["tenant"], 0) + 1
    assert all(by_worker.get(t, 0) >= 3 for t in ("alice", "bob")), f"too few parks to show anything: {by_worker}"
    assert any(u["kind"] == "Sample" for u in parks), "no sampler park was seen (samplers holding weights park too)"
    for u in parks:
        assert "parked_nvml_after" in u, f"a park without NVML readings: {u}"
        left = u["parked_nvml_after"] - u["parked_outside_allocator"]
        assert left <= LIMIT, f"a park left {left / MIB:.0f} MiB beside the CUDA context: {u}"
        assert u["parked_residue"] <= LIMIT, u
        freed = u["parked_nvml_before"] - u["parked_nvml_after"]
        assert freed >= u["parked_bytes"] - LIMIT, f"freed {freed / MIB:.0f} MiB of a {u['parked_bytes'] / MIB:.0f}" \
                                                   f" MiB state: {u}"


def test_losses_equal_between_tenants_and_a_run_with_no_parks(runs: dict[str, Any], record: Any) -> None:
    parked, alone = runs["parks"]["losses"], runs["alone"]["losses"]
    record(losses=parked, losses_alone=alone)
    for kind in ("full", "lora"):
        assert parked[f"alice.{kind}"] == parked[f"bob.{kind}"] == alone[f"alice.{kind}"], kind
        assert parked[f"alice.{kind}"][3] == parked[f"alice.{kind}"][2], f"{kind}: load_state did not go back"


def test_sampling_from_sampler_weights_after_parks_equals_no_parks(runs: dict[str, Any], record: Any) -> None:
    parked, alone = runs["parks"]["samples"], runs["alone"]["samples"]
    record(samples=parked)
    for kind in ("full", "lora"):
        assert parked[f"alice.{kind}"] == parked[f"bob.{kind}"] == alone[f"alice.{kind}"], kind


def test_the_shared_base_holder_keeps_one_copy(runs: dict[str, Any], record: Any) -> None:
    base, holders = runs["base_bytes"], runs["holders"]
    record(base_bytes=base, holder_nvml_bytes=holders)
    assert holders, "no base holder ran"
    for name, n in holders.items():
        assert n <= base + 1536 * MIB, f"holder of {name} uses {n / MIB:.0f} MiB for a {base / MIB:.0f} MiB base"
