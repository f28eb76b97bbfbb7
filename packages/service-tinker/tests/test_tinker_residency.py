"""``capacity_bytes``: LoRA tenants that fit stay resident between turns (a switch moves nothing), tenants that
do not fit are parked, and either way every loss equals the tenant's run alone. Also: base models loaded from
local files, start failures that name their cause, and finished futures forgotten after ``future_ttl_s``.

Real parts throughout: the service's own orchestrator (gRPC on loopback), spawned workers, the tinker SDK.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types
from tinker_testlib import batch

from rota_tinker import DEFAULT_BASE_MODELS, BaseModelSpec, ServiceConfig, Tenant, TinkerService, save_base

TIMEOUT = 120
STEPS = 3
KEYS = {  # 128 random bits and more: the service refuses guessable keys
    "ann": "tml-qbpBoC2q0f9WE1ZTyJovxXKPE_xpGr9MxzI92bCUIvw",
    "ben": "tml--7f5yE3eVOcAMWy06vempVME67seZgpVvlihJIsvHTI",
}


@contextmanager
def serving(tmp: Path, **config: object) -> Iterator[tuple[TinkerService, dict[str, tinker.ServiceClient]]]:
    """The service (no endpoint: with capacity_bytes it runs its own orchestrator) and one SDK client per tenant."""
    cfg = ServiceConfig(tenants=tuple(Tenant(n, k) for n, k in KEYS.items()), data_dir=str(tmp), long_poll_s=2.0,
                        group=f"residency-{time.monotonic_ns()}", **config)  # type: ignore[arg-type]
    with TinkerService(cfg) as svc:
        clients = {n: tinker.ServiceClient(base_url=svc.url, api_key=k) for n, k in KEYS.items()}
        try:
            yield svc, clients
        finally:
            for c in clients.values():
                c.close("success").result(30)


def train(sc: tinker.ServiceClient, base: str, seed: int, barrier: threading.Barrier | None = None) -> list[float]:
    """A LoRA model trained STEPS steps; with ``barrier``, every step waits for the other tenant's (lockstep)."""
    tc = sc.create_lora_training_client(base_model=base, rank=4, seed=seed).result(timeout=TIMEOUT)
    losses = []
    for step in range(STEPS):
        if barrier is not None:
            barrier.wait(TIMEOUT)
        fb = tc.forward_backward(batch(step, seed=seed), "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result(timeout=TIMEOUT).metrics["loss:sum"])
        op.result(timeout=TIMEOUT)
    return losses


def lockstep(clients: dict[str, tinker.ServiceClient]) -> dict[str, list[float]]:
    """Both tenants train at once, step by step together: the group switches between them every step."""
    barrier = threading.Barrier(len(clients))
    out: dict[str, list[float]] = {}
    errors: list[BaseException] = []

    def run(i: int, name: str) -> None:
        try:
            out[name] = train(clients[name], "rota/tiny", seed=20 + i, barrier=barrier)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


@pytest.mark.parametrize(("capacity", "parks_expected"), [(8 * 2**30, False), (1, True)],
                         ids=["both-fit-stay-resident", "one-fits-park-at-switch"])
def test_capacity_decides_what_parks_and_numbers_never_change(tmp_path: Path, capacity: int,
                                                              parks_expected: bool) -> None:
    with serving(tmp_path, capacity_bytes=capacity) as (svc, clients):
        together = lockstep(clients)
        units = [u for u in svc.unit_timings() if u["kind"] in ("ForwardBackward", "OptimStep")]
        alone = {name: train(clients[name], "rota/tiny", seed=20 + i) for i, name in enumerate(clients)}
    assert not any(u["failed"] for u in units)
    turns = {u["tenant"] for u in units if u.get("new_turn")}
    assert turns == set(KEYS)  # both took turns on the one group
    parked = sum(u.get("parked_bytes", 0.0) for u in units)
    assert (parked > 0) is parks_expected, f"capacity {capacity}: {parked} bytes parked"
    assert together == alone


def test_base_model_from_a_local_file(tmp_path: Path) -> None:
    tiny = DEFAULT_BASE_MODELS["rota/tiny"]
    same, other, wrong = tmp_path / "same.pt", tmp_path / "other.pt", tmp_path / "wrong.pt"
    save_base(tiny, str(same))  # rota/tiny's own weights, from a file
    save_base(BaseModelSpec("x", vocab=tiny.vocab, dim=tiny.dim, layers=tiny.layers, heads=tiny.heads, seed=1),
              str(other))
    save_base(BaseModelSpec("x", vocab=tiny.vocab, dim=64, layers=tiny.layers, heads=tiny.heads), str(wrong))
    shape = {"vocab": tiny.vocab, "dim": tiny.dim, "layers": tiny.layers, "heads": tiny.heads}
    bases = {tiny.name: tiny, **{s.name: s for s in (BaseModelSpec("file/same", **shape, path=str(same)),
                                                     BaseModelSpec("file/other", **shape, path=str(other)),
                                                     BaseModelSpec("file/wrong", **shape, path=str(wrong)))}}
    with serving(tmp_path, base_models=bases) as (_svc, clients):
        sc = clients["ann"]
        from_seed = train(sc, "rota/tiny", seed=5)
        assert train(sc, "file/same", seed=5) == from_seed
        assert train(sc, "file/other", seed=5) != from_seed  # the file's weights are the ones used
        with pytest.raises(tinker.RequestFailedError, match=r"file/wrong.*has shape \(128, 64\).*needs \(128, 32\)"):
            train(clients["ben"], "file/wrong", seed=5)


def test_finished_futures_are_forgotten_after_their_ttl(tmp_path: Path) -> None:
    with serving(tmp_path, future_ttl_s=0.2) as (svc, clients):
        train(clients["ann"], "rota/tiny", seed=1)
        with svc.state.lock:
            old = [rid for rid, f in svc.state.futures.items() if f.done.is_set()]
        assert old
        time.sleep(1.3)  # past the TTL and the once-a-second scan
        train(clients["ann"], "rota/tiny", seed=2)  # new futures: the scan runs
        with svc.state.lock:
            assert not set(old) & set(svc.state.futures)
            assert svc.state.forgotten_futures >= len(old)
        r = httpx.post(f"{svc.url}/api/v1/retrieve_future", json={"request_id": old[0]},
                       headers={"X-API-Key": KEYS["ann"]}, timeout=30)
        assert r.status_code == 404 and "kept 0.2 s after they finish" in r.json()["detail"]
