"""The orchestrator's Prometheus metrics (``rota orchestrator serve --metrics-listen HOST:PORT``).

Events are counted as they happen (the engine calls :meth:`OrchestratorMetrics.granted`
and :meth:`OrchestratorMetrics.parked`): turn waits and switch durations as histograms in
seconds, grants, parks and restores by outcome, bytes moved. What is true *now* (who holds
each group, each tenant's state, waiters, residue, prefetch counters) is read from the
engine's groups at scrape time by a collector, so it can never drift from the state.

Each orchestrator has its own registry (several may run in one process, as in tests);
served by prometheus-client's own HTTP server on a separate port.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Waits run from milliseconds (a free group) to minutes (a long queue); switches from
# milliseconds (resident) to tens of seconds (whole-process checkpoints).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
SWITCH_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 120)
TENANT_STATES = ("holding", "waiting", "resident", "parked", "faulted", "lost", "idle")


class OrchestratorMetrics:
    """Counters and histograms fed by the engine, plus gauges read from its groups at scrape time."""

    def __init__(self, groups: Callable[[], dict[str, Any]], leading: Callable[[], bool] = lambda: True) -> None:
        self.registry = CollectorRegistry()
        self.wait = Histogram("rota_turn_wait_seconds", "Time from a job's acquire to its grant.", ["group"],
                              buckets=WAIT_BUCKETS, registry=self.registry)
        self.park = Histogram("rota_park_seconds", "Time to park a job (all its ranks, or its agent).", ["group"],
                              buckets=SWITCH_BUCKETS, registry=self.registry)
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

    def collected(self, group: str, tenants: int) -> None:
        self.tenants_collected.labels(group).inc(tenants)

    def serve(self, host: str, port: int) -> Any:
        """Start the HTTP endpoint (``/metrics``) on a thread of its own; returns the server."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


class _StateCollector:
    """Gauges of the groups as they are now: holder, waiters, busy time, tenant states and memory."""

    def __init__(self, groups: Callable[[], dict[str, Any]], leading: Callable[[], bool]) -> None:
        self.groups, self.leading = groups, leading

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily("rota_orchestrator_leader", "1 while this orchestrator grants turns (an HA replica: "
                                "while it leads).", value=1 if self.leading() else 0)
        holder = GaugeMetricFamily("rota_group_holder", "1 for the job that holds the group.", labels=["group", "job"])
        waiters = GaugeMetricFamily("rota_group_waiters", "Jobs waiting for the group.", labels=["group"])
        busy = CounterMetricFamily("rota_group_busy_seconds", "Seconds some job held the group.", labels=["group"])
        switches = CounterMetricFamily("rota_group_switches", "Turns handed to another job.", labels=["group"])
        prefetch = CounterMetricFamily("rota_group_prefetches", "Restores ahead of the grant, by outcome.",
                                       labels=["group", "outcome"])
        state = GaugeMetricFamily("rota_tenant_state", "1 for the state each tenant is in.",
                                  labels=["group", "job", "state"])
        host = GaugeMetricFamily("rota_tenant_host_bytes", "Host memory behind a tenant's parked state.",
                                 labels=["group", "job"])
        residue = GaugeMetricFamily("rota_tenant_residue_bytes", "Device bytes a tenant's last park left.",
                                    labels=["group", "job"])
        for gid, g in sorted(dict(self.groups()).items()):
            if g.holder:
                holder.add_metric([gid, g.holder], 1)
            waiters.add_metric([gid], len(g.queue))
            busy.add_metric([gid], g.busy_seconds)
            switches.add_metric([gid], g.switches)
            for outcome in ("hits", "misses", "failures", "wasted"):
                prefetch.add_metric([gid, outcome], getattr(g, f"prefetch_{outcome}"))
            for job, rec in sorted(dict(g.tenants).items()):
                for name in TENANT_STATES:
                    state.add_metric([gid, job, name], 1 if rec.state == name else 0)
                host.add_metric([gid, job], rec.host_bytes)
                residue.add_metric([gid, job], rec.residue_bytes)
        yield from (holder, waiters, busy, switches, prefetch, state, host, residue)


__all__ = ["OrchestratorMetrics"]
