"""A client's TurnStats keep only the latest entries (a long-running tenant must not grow without bound), and
readers that take what is new since their last look get exactly that, in order, across the bound."""

from __future__ import annotations

import threading

import pytest

import rota._tenant.client as client
from rota._tenant.client import Recent, TurnStats


def test_recent_is_bounded_and_since_returns_what_is_new(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "STATS_KEEP", 4)
    r = Recent()
    seen = 0
    got: list[int] = []
    for i in range(10):
        r.append(i)
        if i % 3 == 2:
            new, seen = r.since(seen)
            got += new
    new, seen = r.since(seen)
    got += new
    assert got == list(range(10)) and seen == r.total == 10
    assert list(r) == [6, 7, 8, 9] and r[-1] == 9 and len(r) == 4
    for i in range(10, 20):  # a reader that fell behind by more than the bound gets what is still kept
        r.append(i)
    assert r.since(seen) == ([16, 17, 18, 19], 20)
    assert r.since(20) == ([], 20)


def test_concurrent_appends_are_all_counted() -> None:
    stats = TurnStats()

    def add(k: int) -> None:
        for i in range(2000):
            stats.events.append(("park", float(k), float(i)))

    threads = [threading.Thread(target=add, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    new, total = stats.events.since(0)
    assert total == 8000 and len(new) == len(stats.events) == min(8000, client.STATS_KEEP)
