"""The orchestrator's Prometheus metrics (``rota orchestrator serve --metrics-listen HOST:PORT``).

Events are counted as they happen (the orchestrator calls :meth:`OrchestratorMetrics.granted`,
:meth:`OrchestratorMetrics.parked` and :meth:`OrchestratorMetrics.restored`): turn waits, park
and restore durations as histograms in seconds, grants, parks and restores by outcome, bytes
moved. What is true *now* (who holds each group, each tenant's state, waiters, residue,
prefetch counters) is read from the orchestrator's groups at scrape time by a collector, so it
can never drift from the state; those families (:func:`group_families`) are also what
``rota status --prometheus`` prints.

Each orchestrator has its own registry (several may run in one process, as in tests);
served by prometheus-client's own HTTP server on a separate port.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rota._orchestrator.state import TENANT_STATES

# Waits run from milliseconds (a free group) to minutes (a long queue); switches from
# milliseconds (resident) to tens of seconds (whole-process checkpoints).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
SWITCH_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 120)


class OrchestratorMetrics:
    """Counters and histograms fed by the orchestrator, plus gauges read from its groups at scrape time."""

    def __init__(self, groups: Callable[[], dict[str, Any]], leading: Callable[[], bool] = lambda: True) -> None:
        self.registry = CollectorRegistry()
        self.wait = Histogram("rota_turn_wait_seconds", "Time from a job's acquire to its grant.", ["group"],
                              buckets=WAIT_BUCKETS, registry=self.registry)
        self.park = Histogram("rota_park_seconds", "Time to park a job (all its ranks, or its agent).", ["group"],
                              buckets=SWITCH_BUCKETS, registry=self.registry)
        self.restore = Histogram("rota_restore_seconds", "Time to restore a parked job: at its grant (its slowest "
                                 "rank, reported with the release), by its agent, or by a prefetch ahead of it.",
                                 ["group"], buckets=SWITCH_BUCKETS, registry=self.registry)
        self.restores = Counter("rota_restores", "Restores the orchestrator drove (agent, prefetch) by outcome "
                                "(ok, failed).", ["group", "outcome"], registry=self.registry)
        self.grants = Counter("rota_grants", "Turns granted.", ["group"], registry=self.registry)
        self.parks = Counter("rota_parks", "Parks by outcome (ok, failed).", ["group", "outcome"],
                             registry=self.registry)
        self.bytes_parked = Counter("rota_parked_bytes", "Bytes moved to host memory by parks.", ["group"],
                                    registry=self.registry)
        self.tenants_collected = Counter("rota_tenants_collected", "Ended tenants forgotten after their grace "
                                         "period (10 minutes by default).", ["group"], registry=self.registry)
        self.registry.register(_StateCollector(groups, leading))

    def granted(self, group: str, waited_s: float) -> None:
        self.grants.labels(group).inc()
        self.wait.labels(group).observe(max(0.0, waited_s))

    def parked(self, group: str, ok: bool, nbytes: int, seconds: float) -> None:
        self.parks.labels(group, "ok" if ok else "failed").inc()
        if ok:
            self.park.labels(group).observe(max(0.0, seconds))
            self.bytes_parked.labels(group).inc(max(0, nbytes))

    def restored(self, group: str, ok: bool, seconds: float) -> None:
        self.restores.labels(group, "ok" if ok else "failed").inc()
        if ok:
            self.restore.labels(group).observe(max(0.0, seconds))

    def restore_reported(self, group: str, seconds: float) -> None:
        """A tenant's own restore at its grant (reported with its release): timed, not counted in rota_restores."""
        self.restore.labels(group).observe(max(0.0, seconds))

    def collected(self, group: str, tenants: int) -> None:
        self.tenants_collected.labels(group).inc(tenants)

    def forget(self, group: str) -> None:
        """Drop every series of ``group`` (the orchestrator forgot it): 12,000 collected groups kept 40 MB of series."""
        for metric in (self.wait, self.park, self.restore, self.grants, self.bytes_parked, self.tenants_collected):
            with contextlib.suppress(KeyError):
                metric.remove(group)
        for metric in (self.parks, self.restores):
            for outcome in ("ok", "failed"):
                with contextlib.suppress(KeyError):
                    metric.remove(group, outcome)

    def serve(self, host: str, port: int) -> Any:
        """Start the HTTP endpoint (``/metrics``) on a thread of its own; returns the server."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


class _StateCollector:
    """The leader gauge, and the groups as they are now (:func:`group_families`, as ``rota status`` reads them)."""

    def __init__(self, groups: Callable[[], dict[str, Any]], leading: Callable[[], bool]) -> None:
        self.groups, self.leading = groups, leading

    def collect(self) -> Iterator[Any]:
        from rota._orchestrator.service import group_info

        yield GaugeMetricFamily("rota_orchestrator_leader", "1 while this orchestrator grants turns (an HA replica: "
                                "while it leads).", value=1 if self.leading() else 0)
        yield from group_families([group_info(g) for _, g in sorted(dict(self.groups()).items())])


class GroupsCollector:
    """:func:`group_families` of fixed GroupInfo messages (``rota status --prometheus``)."""

    def __init__(self, groups: Iterable[Any]) -> None:
        self.groups = list(groups)

    def collect(self) -> Iterator[Any]:
        yield from group_families(self.groups)


PREFETCH_OUTCOMES = ("hit", "miss", "failed", "wasted")


def group_families(groups: Iterable[Any]) -> list[Any]:
    """Gauges and counters of rota.v1 GroupInfo messages: one vocabulary for ``/metrics`` (the orchestrator's groups)
    and ``rota status --prometheus`` (a Status reply), so both print the same names, labels and values."""
    def family(kind: type, name: str, helptext: str, labels: list[str]) -> Any:
        return kind(name, helptext, labels=labels)

    g_, gj = ["group"], ["group", "job"]
    holder = family(GaugeMetricFamily, "rota_group_holder", "1 for the job that holds the group.", gj)
    waiters = family(GaugeMetricFamily, "rota_group_waiters", "Jobs waiting for the group.", g_)
    busy = family(CounterMetricFamily, "rota_group_busy_seconds", "Seconds some job held the group.", g_)
    switches = family(CounterMetricFamily, "rota_group_switches", "Turns handed to another job.", g_)
    prefetch = family(CounterMetricFamily, "rota_group_prefetches", "Restores ahead of the grant by outcome: hit "
                      "(the grant found the job restored), miss (the grant still restored it), failed, wasted "
                      "(parked again before its grant).", ["group", "outcome"])
    state = family(GaugeMetricFamily, "rota_tenant_state", "1 for the state each tenant is in (ended: it closed "
                   "its session; lost: it vanished without closing).", ["group", "job", "state"])
    turns = family(CounterMetricFamily, "rota_tenant_turns", "Turns granted to the tenant.", gj)
    gpu = family(CounterMetricFamily, "rota_tenant_gpu_seconds", "Seconds the tenant held the group.", gj)
    wait = family(GaugeMetricFamily, "rota_tenant_wait_p99_seconds", "99th percentile of the tenant's recent "
                  "queue waits.", gj)
    park = family(GaugeMetricFamily, "rota_tenant_park_p99_seconds", "99th percentile of the tenant's recent "
                  "parks.", gj)
    parked = family(GaugeMetricFamily, "rota_tenant_parked_bytes", "Bytes of the tenant's last park.", gj)
    host = family(GaugeMetricFamily, "rota_tenant_host_bytes", "Host memory behind a tenant's parked state.", gj)
    residue = family(GaugeMetricFamily, "rota_tenant_residue_bytes", "Device bytes a tenant's last park left.", gj)
    failed = family(CounterMetricFamily, "rota_tenant_switch_failures", "Parks (state left on the device) and "
                    "restores by an agent or ahead of the grant (state left parked) of the tenant that failed.",
                    ["group", "job", "kind"])
    for g in groups:
        gid = g.group_id
        if g.holder:
            holder.add_metric([gid, g.holder], 1)
        waiters.add_metric([gid], len(g.queue))
        busy.add_metric([gid], g.busy_seconds)
        switches.add_metric([gid], g.switches)
        counts = (g.prefetch_hits, g.prefetch_misses, g.prefetch_failures, g.prefetch_wasted)
        for outcome, n in zip(PREFETCH_OUTCOMES, counts, strict=True):
            prefetch.add_metric([gid, outcome], n)
        for t in sorted(g.tenants, key=lambda t: t.job_id):
            job = [gid, t.job_id]
            for name in TENANT_STATES:
                state.add_metric([*job, name], 1 if t.state == name else 0)
            turns.add_metric(job, t.turns)
            gpu.add_metric(job, t.gpu_seconds)
            wait.add_metric(job, t.wait_p99_ms / 1000.0)
            park.add_metric(job, t.park_p99_ms / 1000.0)
            parked.add_metric(job, t.parked_bytes)
            host.add_metric(job, t.host_bytes)
            residue.add_metric(job, t.residue_bytes)
            failed.add_metric([*job, "park"], t.parks_failed)
            failed.add_metric([*job, "restore"], t.restores_failed)
    return [holder, waiters, busy, switches, prefetch, state, turns, gpu, wait, park, parked, host, residue, failed]


__all__ = ["GroupsCollector", "OrchestratorMetrics", "group_families"]
