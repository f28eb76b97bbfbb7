"""Placement across a host's devices, pure (rota.placement) and device names (rota.devices)."""

from __future__ import annotations

import random

import pytest

from rota.devices import parse_devices
from rota.errors import ConfigError
from rota.placement import DeviceView, evict_plan, place

GB = 10**9


@pytest.mark.parametrize(("value", "want"), [
    ("0,1", ("cuda:0", "cuda:1")), ("cuda:1, cuda:0", ("cuda:1", "cuda:0")), (3, ("cuda:3",)),
    (["0", 1], ("cuda:0", "cuda:1")), ("", ()), (None, ()), ("fake:0,fake:1", ("fake:0", "fake:1")),
    ("cuda:01", ("cuda:1",)),
])
def test_device_names(value, want):
    assert parse_devices(value) == want


@pytest.mark.parametrize(("value", "says"), [
    ("0,0", "names cuda:0 twice"), ("gpu0", "'gpu0' is not a device"), ("cuda:0,fake:1", "mixes"),
    ("-1", "'-1' is not a device"), ("cuda:", "is not a device"), (True, "is not a device list"),
    (",".join(str(i) for i in range(65)), "at most 64"), ("0;1", "is not a device"),
])
def test_bad_device_names_say_what_and_how(value, says):
    with pytest.raises(ConfigError, match="ROTA_DEVICES") as err:
        parse_devices(value, "ROTA_DEVICES")
    assert says in str(err.value)
    if "not a device" in says:
        assert "cuda:N" in str(err.value)  # the fix


def test_all_counts_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb")  # as Slurm's GRES or a device claim sets it
    assert parse_devices("all") == ("cuda:0", "cuda:1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES .*list the devices instead"):
        parse_devices("all", "ROTA_DEVICES")


def v(dev, busy=False, residents=None, capacity=100 * GB, queue=0, holder="", residue=0):
    return DeviceView(dev, busy=busy, queue=queue, residents=residents or {}, capacity=capacity, holder=holder,
                      residue=residue)


def test_resident_goes_to_its_free_device():
    views = [v("cuda:0"), v("cuda:1", residents={"a": 60 * GB})]
    c = place("a", 60 * GB, views, home="cuda:1")
    assert (c.device, c.move_from) == ("cuda:1", "")


def test_resident_on_busy_device_moves_to_a_free_device_where_it_fits():
    views = [v("cuda:0", busy=True, holder="b", residents={"b": 60 * GB}), v("cuda:1", residents={"c": 20 * GB})]
    c = place("a", 60 * GB, views, home="cuda:0")
    assert (c.device, c.move_from) == ("cuda:1", "cuda:0")


def test_resident_waits_for_its_device_when_moving_would_park_someone():
    views = [v("cuda:0", busy=True, holder="b", residents={"b": 60 * GB}), v("cuda:1", residents={"c": 60 * GB})]
    assert place("a", 60 * GB, views, home="cuda:0").device == "cuda:0"


def test_parked_job_goes_where_it_fits_without_parking_free_first():
    views = [v("cuda:0", residents={"b": 60 * GB}), v("cuda:1", busy=True, queue=2, residents={"c": 10 * GB})]
    assert place("a", 30 * GB, views).device == "cuda:0"  # both fit: the free one
    views = [v("cuda:0", residents={"b": 90 * GB}), v("cuda:1", busy=True, queue=2, residents={"c": 10 * GB})]
    assert place("a", 30 * GB, views).device == "cuda:1"  # fits only on the busy one: no park needed there


def test_otherwise_parks_where_it_costs_least_counting_next_turns():
    # cuda:0's resident waits for a turn (parking it costs a restore too); cuda:1's does not
    views = [v("cuda:0", residents={"b": 60 * GB}), v("cuda:1", residents={"c": 70 * GB})]
    c = place("a", 60 * GB, views, waiting={"b"})
    assert (c.device, c.evict) == ("cuda:1", ("c",))
    c = place("a", 60 * GB, views, waiting=set())
    assert (c.device, c.evict) == ("cuda:0", ("b",))  # nobody waits: fewer bytes


def test_evict_plan_is_the_cheapest_set_and_never_the_holder():
    residents = {"h": 40 * GB, "big": 50 * GB, "s1": 20 * GB, "s2": 25 * GB}
    assert evict_plan(residents, 30 * GB, 140 * GB, keep={"h"}) == ["s2"]  # 135+30-140 = 25 over: s2 is enough
    assert sorted(evict_plan(residents, 50 * GB, 140 * GB, keep={"h"})) == ["s1", "s2"]  # 45 over: 45 < 50
    assert evict_plan(residents, 50 * GB, 140 * GB, keep={"h"}, waiting={"s1"}) == ["big"]  # s1's turn: 65 > 50
    assert evict_plan({"h": 100 * GB}, 60 * GB, 140 * GB, keep={"h"}) is None
    assert evict_plan({"a": 1, "b": 0}, 5, 0) == ["a"]  # capacity unknown: everyone holding bytes
    assert evict_plan({"a": 10}, 5, 100) == []


def test_placement_property_fits_and_never_parks_the_holder():
    """Random devices and residents: the choice is a given device; without parking it fits; a plan never parks
    the holder and frees enough."""
    rng = random.Random(32)
    for _ in range(2000):
        cap = rng.choice([0, 100, 140])
        views = []
        for i in range(rng.randint(1, 4)):
            res = {f"j{i}{k}": rng.randint(0, 80) for k in range(rng.randint(0, 3))}
            holder = rng.choice(["", *res])
            views.append(v(f"cuda:{i}", busy=bool(holder) or rng.random() < 0.3, residents=res, capacity=cap,
                           holder=holder, residue=rng.choice([0, 0, 5])))
        need = rng.randint(0, 90)
        home = rng.choice(["", *[x.device for x in views]])
        c = place("x", need, views, home=home, waiting={f"j0{k}" for k in range(2)})
        view = next(x for x in views if x.device == c.device)
        assert view.holder not in c.evict or not view.holder
        if c.evict:
            freed = sum(view.residents[j] for j in c.evict)
            assert cap == 0 or view.used() - freed + need <= cap
        if c.move_from:
            assert c.move_from == home and not view.busy and view.fits(need)


def test_best_fit_packs_three_60gb_trainers_and_their_samplers_on_two_devices():
    """The issue's 60 GB case: 3 trainers of 60.6 GB and 3 samplers of 15.2 GB on two 130 GB devices fit only as
    two trainers on one device; placing each on the free device with the least room left finds that, whatever
    the order they arrive in (the emptiest device first would leave the third trainer no room)."""
    import itertools

    cap, t, s = 130 * GB, 60_600_000_000, 15_200_000_000
    jobs = {"t1": t, "t2": t, "t3": t, "s1": s, "s2": s, "s3": s}
    for order in itertools.permutations(jobs):
        held: dict[str, dict[str, int]] = {"cuda:0": {}, "cuda:1": {}}
        for job in order:
            c = place(job, jobs[job], [v(d, residents=held[d], capacity=cap) for d in held])
            assert not c.evict, (order, job, held)
            held[c.device][job] = jobs[job]
        assert all(sum(h.values()) <= cap for h in held.values())
