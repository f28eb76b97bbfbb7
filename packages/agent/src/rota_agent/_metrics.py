"""The agent's Prometheus metrics (``rota agent serve --metrics-listen HOST:PORT``).

Counted as operations finish (:meth:`AgentMetrics.finished`, called by the agent):
parks (snapshots) and restores by backend and outcome, their durations as histograms in
seconds, the bytes they moved. Read from the agent's jobs at scrape time: jobs by state,
and the device bytes each parked job left behind (its residue), so those gauges are never
stale. Each agent has its own registry, served by prometheus-client's HTTP server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from rota.wire import snapshot_agent_pb2 as pb

__all__ = ["AgentMetrics"]

# Parks and restores run from milliseconds (an adapter's offload) to minutes (a large
# whole-process checkpoint through host memory).
OPERATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
KIND_NAMES = {"snapshot": "park", "restore": "restore"}


class AgentMetrics:
    """Counters and histograms of finished operations, plus gauges read from the jobs at scrape time."""

    def __init__(self, jobs: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        labels = ["operation", "backend"]
        self.seconds = Histogram("rota_agent_operation_seconds", "Duration of a successful park or restore.",
                                 labels, buckets=OPERATION_BUCKETS, registry=self.registry)
        self.operations = Counter("rota_agent_operations", "Parks and restores by outcome (ok, failed).",
                                  [*labels, "outcome"], registry=self.registry)
        self.moved = Counter("rota_agent_moved_bytes", "Device bytes moved out (park) or back (restore).", labels,
                             registry=self.registry)
        self.registry.register(_JobCollector(jobs))

    def finished(self, kind: str, backend: str, ok: bool, seconds: float, device_bytes: int | None) -> None:
        """One operation ended (``kind``: snapshot or restore)."""
        operation = KIND_NAMES.get(kind, kind)
        self.operations.labels(operation, backend, "ok" if ok else "failed").inc()
        if ok:
            self.seconds.labels(operation, backend).observe(max(0.0, seconds))
            self.moved.labels(operation, backend).inc(max(0, device_bytes or 0))

    def serve(self, host: str, port: int) -> Any:
        """Start ``/metrics`` on a thread of its own; returns the server."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


class _JobCollector:
    def __init__(self, jobs: Callable[[], dict[str, Any]]) -> None:
        self.jobs = jobs

    def collect(self) -> Iterator[Any]:
        states = GaugeMetricFamily("rota_agent_jobs", "Registered jobs by state.", labels=["state"])
        residue = GaugeMetricFamily("rota_agent_residue_bytes", "Device bytes a job's last park left behind.",
                                    labels=["group", "job"])
        counts = {pb.JobState.Name(v).removeprefix("JOB_STATE_").lower(): 0 for v in pb.JobState.values()}
        counts.pop("unspecified", None)
        for job_id, job in sorted(dict(self.jobs()).items()):
            name = pb.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()
            counts[name] = counts.get(name, 0) + 1
            if job.residue is not None:
                residue.add_metric([job.group, job_id], job.residue.counted)
        for name, n in counts.items():
            states.add_metric([name], n)
        yield from (states, residue)
