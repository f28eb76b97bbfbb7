"""A group over several GPUs on real devices: a turn granted on another GPU than the state's.

One GPU: the grant names the device (cuda:0) and a parked tenant is restored there through the
new path; losses equal a run with no parks. Two GPUs (skipped with fewer): a resident model moves
cuda:0 -> cuda:1 device to device, a parked one is restored onto cuda:1, and through the
orchestrator a resident tenant whose GPU is busy moves to the free one. Every time the losses
(with dropout: the RNG state moves too) equal a run with no moves, bit for bit, and the old GPU
holds nothing of the model afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from rota import ParkPlan

STEPS = 6
MIB = 1 << 20
TWO = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (nvidia-h200-x2)")


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """One orchestrator for the module, told the devices' size (placement needs it)."""
    from rota.orchestrator import OrchestratorConfig
    from rota.testing import running_orchestrator

    with running_orchestrator(OrchestratorConfig(ttl_s=30.0, park_timeout_s=120.0, capacity_bytes=60 << 30)) as up:
        yield up[0]


def _model(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Dropout(0.1), nn.Linear(4096, 1024),
                          nn.LayerNorm(1024)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
    device = next(model.parameters()).device
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(i)).to(device)
    opt.zero_grad(set_to_none=False)  # grads stay tensors: they move (or park) with the model
    loss = (model(x) - x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def _reference() -> list[float]:
    model, opt = _model("cuda:0")
    return [_step(model, opt, i) for i in range(STEPS)]


def _on(model: nn.Module, opt: torch.optim.Optimizer, device: str) -> None:
    """Every parameter, grad and optimizer tensor of the model is on ``device`` (Adam's step counts stay where
    torch keeps them)."""
    want = torch.device(device)
    for p in model.parameters():
        assert p.device == want and (p.grad is None or p.grad.device == want)
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k != "step":
                assert v.device == want, k


def test_one_gpu_grant_names_the_device_and_restores_there(served, record):
    """The one-GPU part: a group over [cuda:0]; every turn is granted on cuda:0 and a parked tenant is
    restored there (ParkPlan.device) through the new path."""
    import rota
    import rota_fsdp

    gpu = rota.connect(group="one", tenant="t1", endpoint=served, devices=["cuda:0"])
    try:
        assert gpu.device == "cuda:0"
        with gpu.turn() as grant:
            assert grant.device == "cuda:0"
            model, opt = _model(gpu.device)
            tracked = rota_fsdp.track(gpu, model, opt)
        losses = []
        for i in range(STEPS):
            gpu.park()  # as if another tenant needed the device
            with gpu.turn() as grant:
                assert grant.device == gpu.device == "cuda:0"
                losses.append(_step(model, opt, i))
        assert losses == _reference()
        assert gpu.stats.restores.total == STEPS and gpu.stats.moves.total == 0
        tracked.park()
        tracked.restore(ParkPlan(device="cuda:0"))  # the same device named explicitly: a plain restore
        _on(model, opt, "cuda:0")
        record(restores=gpu.stats.restores.total)
        tracked.untrack()
    finally:
        gpu.close()


def _baseline(device: int) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


@TWO
@pytest.mark.parametrize("parked", [False, True], ids=["resident-peer-copy", "parked-restore-elsewhere"])
def test_move_between_two_gpus_is_bit_identical_and_leaves_nothing(served, record, parked):
    import rota
    import rota_fsdp

    reference = _reference()
    base0 = _baseline(0)
    gpu = rota.connect(group=f"two-{parked}", tenant="m", endpoint=served)  # a tenant of one device, moved by hand
    try:
        model, opt = _model("cuda:0")
        tracked = rota_fsdp.track(gpu, model, opt)
        losses = [_step(model, opt, i) for i in range(STEPS // 2)]
        nbytes = sum(tracked.footprint().values())
        if parked:
            tracked.park()
        torch.cuda.synchronize()
        result = tracked.restore(ParkPlan(device="cuda:1"))
        _on(model, opt, "cuda:1")
        assert tracked.device == torch.device("cuda:1") and torch.cuda.current_device() == 1
        left = _baseline(0) - base0
        assert left <= MIB, f"{left} bytes of the model stayed on cuda:0"
        losses += [_step(model, opt, i) for i in range(STEPS // 2, STEPS)]
        assert losses == reference  # dropout included: the RNG state moved with the model
        record(bytes=nbytes, seconds=result.seconds, gbps=nbytes / result.seconds / 1e9, left_on_cuda0=left)
        tracked.untrack()
    finally:
        gpu.close()
        torch.cuda.set_device(0)


@TWO
def test_orchestrator_moves_a_resident_tenant_to_the_free_gpu(served, record):
    """a on cuda:0; b takes cuda:1; c takes cuda:0 beside a; b leaves cuda:1: a's next turn finds its GPU busy
    and the other free, so it moves there device to device, and its losses stay those of a run with no move."""
    import rota
    import rota_fsdp

    devices = ["cuda:0", "cuda:1"]
    reference = _reference()
    gpus = {n: rota.connect(group="pair", tenant=n, endpoint=served, devices=devices) for n in "abc"}
    try:
        with gpus["a"].turn() as grant:
            assert grant.device == "cuda:0"
            model, opt = _model(grant.device)
            tracked = rota_fsdp.track(gpus["a"], model, opt)
            losses = [_step(model, opt, i) for i in range(STEPS // 2)]
        assert gpus["b"].acquire().device == "cuda:1"
        assert gpus["c"].acquire().device == "cuda:0"
        gpus["b"].release()
        with gpus["a"].turn() as grant:
            assert grant.device == "cuda:1" and gpus["a"].stats.moves.total == 1
            _on(model, opt, "cuda:1")
            losses += [_step(model, opt, i) for i in range(STEPS // 2, STEPS)]
        gpus["c"].release()
        assert losses == reference
        move = gpus["a"].stats.moves[-1]
        record(move_bytes=move.bytes_moved, move_seconds=move.seconds)
        tracked.untrack()
    finally:
        for g in gpus.values():
            g.close()
        torch.cuda.set_device(0)
