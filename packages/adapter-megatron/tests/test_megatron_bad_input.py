"""Bad input is refused with a message naming the problem; the version check names the fix."""

from __future__ import annotations

import pytest
import torch

import rota_megatron
from rota_megatron._compat import check_megatron


def _chunk(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))


def test_double_track_of_a_chunk(torch_connect):
    gpu = torch_connect("trainer")
    a, b = _chunk(), _chunk(1)
    first = rota_megatron.track(gpu, [a, b])
    with pytest.raises(rota_megatron.AlreadyTracked,
                       match=r"parameter '0\.0\.weight' of megatron\[1\] is already tracked through megatron\[2\]"):
        rota_megatron.track(gpu, [b])
    with pytest.raises(rota_megatron.AlreadyTracked, match="appears twice"):
        rota_megatron.track(torch_connect("other"), [_chunk(2)] * 2)
    first.untrack()
    rota_megatron.track(gpu, [a, b])  # fine once untracked


def test_chunk_tracked_by_rota_fsdp_is_refused(torch_connect):
    rota_fsdp = pytest.importorskip("rota_fsdp")  # another torch adapter: one registry for both

    gpu = torch_connect("trainer")
    chunk = _chunk()
    rota_fsdp.track(gpu, chunk)
    with pytest.raises(rota_megatron.AlreadyTracked):
        rota_megatron.track(gpu, [chunk])


def test_wrong_device(torch_connect):
    gpu = torch_connect("trainer")
    with pytest.raises(rota_megatron.DeviceMismatch, match=r"'chunk0\.0\.weight' is on cpu but the tenant's "
                                                           r"device is meta"):
        rota_megatron.track(gpu, [_chunk()], device="meta")
    chunk = _chunk()
    chunk[1].register_buffer("on_meta", torch.empty(3, device="meta"))
    with pytest.raises(rota_megatron.DeviceMismatch, match=r"chunk0\.1\.on_meta"):
        rota_megatron.track(gpu, [chunk])


def test_bad_chunks_and_optimizers(torch_connect):
    gpu = torch_connect("trainer")
    with pytest.raises(rota_megatron.TrackingError, match="non-empty list of modules"):
        rota_megatron.track(gpu, [])
    with pytest.raises(rota_megatron.TrackingError, match="non-empty list of modules"):
        rota_megatron.track(gpu, ["not a module"])  # type: ignore[list-item]
    with pytest.raises(rota_megatron.TrackingError, match="cannot find optimizer state in object"):
        rota_megatron.track(gpu, [_chunk()], object())
    other = _chunk(5)
    with pytest.raises(rota_megatron.TrackingError, match="not in model_chunks"):
        rota_megatron.track(gpu, [_chunk()], torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(rota_megatron.TrackingError, match="kv_cache"):
        rota_megatron.track(gpu, [_chunk()], tags=("weights", "kv_cache"))


def test_forward_while_parked_and_park_during_turn(torch_connect):
    gpu = torch_connect("trainer")
    a, b = _chunk(), _chunk(1)
    opt = torch.optim.AdamW(list(a.parameters()) + list(b.parameters()), lr=1e-2)
    tracked = rota_megatron.track(gpu, [a, b], opt)
    with gpu.turn():
        (b(a(torch.randn(2, 4)))).sum().backward()
        opt.step()
        with pytest.raises(rota_megatron.HoldsTurn, match="holds group"):
            tracked.park()
    gpu.park()
    assert tracked.parked and all(p.untyped_storage().nbytes() == 0 for p in b.parameters())
    with pytest.raises(RuntimeError, match="is parked"):
        b(torch.randn(2, 4))  # every chunk is guarded, not only the first
    with gpu.turn():
        b(a(torch.randn(2, 4)))
    assert not tracked.parked


def test_version_check_names_the_fix():
    assert check_megatron() == rota_megatron.MEGATRON_VERSION
    assert check_megatron("0.16.0rc1") == "0.16.0rc1"
    for bad in ("0.15.3", "0.17.0"):
        with pytest.raises(rota_megatron.MegatronVersionError, match=r'pip install "megatron-core>=0\.16,<0\.17"'):
            check_megatron(bad)


def test_entry_point_is_wired():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="rota")}
    assert eps.get("rota_megatron") == "rota_megatron.plugin"
