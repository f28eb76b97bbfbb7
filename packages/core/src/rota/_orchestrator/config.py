"""An orchestrator's knobs (:class:`OrchestratorConfig`) and the bounds of every number a caller sends.

Environment:
    ROTA_AGENTS   comma-separated ``host:port`` of node agents (when ``agents`` is unset)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from rota._ids import check_id
from rota._types import TurnRequest
from rota.config import MAX_PRIORITY, MIN_PRIORITY
from rota.devices import MAX_DEVICES, parse_devices
from rota.errors import InvalidArgument
from rota.policies import Fifo, Policy
from rota.residue import DEFAULT_RESIDUE_MAX_BYTES


@dataclass
class OrchestratorConfig:
    """Knobs of one orchestrator; every value is validated by :meth:`check`."""

    groups: tuple[str, ...] = ()  # fixed groups; empty = create on first use
    policy: Policy = field(default_factory=Fifo)
    ttl_s: float = 10.0  # a session silent this long is dead
    park_timeout_s: float = 120.0  # a park not acknowledged by then faults the tenant
    v1_max_turn_s: float = 600.0  # turn limit for clients without a session (0 = none): they send no heartbeats
    idle_group_ttl_s: float = 600.0  # a group with nothing in it for this long is forgotten (0 = never)
    ended_tenant_ttl_s: float = 600.0  # a tenant that left (idle, lost, faulted) is forgotten after this (0 = never)
    capacity_bytes: int = 0  # device bytes per group for residency checks (0 = unknown)
    idle_exit_s: float = 0.0  # exit after this long with no tenants (0 = never)
    agents: tuple[str, ...] = field(default_factory=lambda: _agents_from_env())  # node agents (rota-agent)
    agent_auth_key: bytes | None = field(default=None, repr=False)  # mints the admin tokens agents check
    agent_tls: Any = field(default=None, repr=False)  # grpc.ChannelCredentials of the agent links (None: plaintext)
    prefetch: bool | None = None  # restore the next waiter during the current turn (None = on iff capacity known)
    # devices a lane may name: cuda:0..N-1 and fake:0..N-1 (None: the GPUs of this host, rota.devices.host_gpus,
    # or MAX_DEVICES on a host without any, and fake:0..FAKE_DEVICES-1); set it where it serves other hosts' GPUs
    devices: int | None = None
    # a tenant's reported residue that counts against the others' room (more counts for nobody: it is capped)
    residue_allowance_bytes: int = DEFAULT_RESIDUE_MAX_BYTES

    @property
    def prefetch_on(self) -> bool:
        """Whether prefetch runs: as set, or by default whenever the device size is known."""
        return self.capacity_bytes > 0 if self.prefetch is None else bool(self.prefetch)

    def check(self) -> None:
        if self.prefetch is not None and not isinstance(self.prefetch, bool):
            raise InvalidArgument(f"prefetch={self.prefetch!r} must be True, False or None "
                                  "(None = on when capacity_bytes > 0)")
        if self.prefetch and self.capacity_bytes <= 0:
            raise InvalidArgument(f"prefetch=True needs the device size, but capacity_bytes={self.capacity_bytes!r}; "
                                  "set --capacity (e.g. 80GiB) or use --no-prefetch")
        for a in self.agents:
            host, _, port = a.rpartition(":")
            if not (a.startswith("unix:") and len(a) > 5) and not (host and port.isdigit() and 0 < int(port) < 65536):
                raise InvalidArgument(f"agent address {a!r} is not host:port or unix:PATH (e.g. 10.0.0.5:9001); "
                                      "fix --agent / ROTA_AGENTS")
        for name in ("ttl_s", "park_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name}={getattr(self, name)!r} must be > 0 seconds")
        for name in ("v1_max_turn_s", "idle_exit_s", "capacity_bytes", "idle_group_ttl_s", "ended_tenant_ttl_s"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name}={getattr(self, name)!r} must be >= 0 (0 disables it)")
        for g in self.groups:
            check_id("group_id", g, group_id=g)
        if self.devices is not None and (isinstance(self.devices, bool) or not isinstance(self.devices, int)
                                         or not 0 <= self.devices <= MAX_DEVICES):
            raise InvalidArgument(f"devices={self.devices!r} must be a whole number 0..{MAX_DEVICES} (the GPUs of the "
                                  "host the lanes are on; --devices N), or None to count this host's")
        if isinstance(self.residue_allowance_bytes, bool) or not isinstance(self.residue_allowance_bytes, int) \
                or not 0 <= self.residue_allowance_bytes <= MAX_BYTES:
            raise InvalidArgument(f"residue_allowance_bytes={self.residue_allowance_bytes!r} must be a byte count "
                                  f"0..{MAX_BYTES} (--residue-allowance, e.g. 256MiB; 0 counts no reported residue)")


def _agents_from_env() -> tuple[str, ...]:
    return tuple(a.strip() for a in os.environ.get("ROTA_AGENTS", "").split(",") if a.strip())


MAX_WEIGHT = 1e6
MAX_BYTES = 1 << 50  # a byte count from a caller (footprint, host memory): 1 PiB
MAX_WORLD_SIZE = 1024  # ranks of one job, and so its sessions (one per rank): 2,862 from one token ended INTERNAL


def check_bytes(name: str, value: int) -> int:
    """A byte count from a caller: >= 0 and at most :data:`MAX_BYTES`."""
    if not 0 <= value <= MAX_BYTES:
        raise InvalidArgument(f"{name} {value} must be between 0 and {MAX_BYTES} bytes")
    return value


def check_request(req: TurnRequest) -> None:
    """Every field of an acquire checked: impossible ranks, extreme priorities, NaN or infinite weights,
    a quiet flag that is not a bool refused."""
    where = f"(job={req.job_id!r}, group={req.group_id!r})"
    if not 0 <= req.world_size <= MAX_WORLD_SIZE or (req.world_size and not 0 <= req.rank < req.world_size):
        raise InvalidArgument(f"rank {req.rank} / world_size {req.world_size} is impossible {where}; "
                              f"need 0 <= rank < world_size <= {MAX_WORLD_SIZE}")
    if not MIN_PRIORITY <= req.priority <= MAX_PRIORITY:
        raise InvalidArgument(f"priority {req.priority} is out of range {where}; use {MIN_PRIORITY}..{MAX_PRIORITY}")
    if not math.isfinite(req.weight) or not 0 < req.weight <= MAX_WEIGHT:
        raise InvalidArgument(f"weight {req.weight!r} must be a finite number in (0, {MAX_WEIGHT:g}] {where}")
    check_bytes("footprint_bytes", req.footprint_bytes)
    if not isinstance(req.quiet, bool):  # the wire's is; an in-process caller's might not be
        raise InvalidArgument(f"quiet={req.quiet!r} must be True or False {where}")
    if req.devices:
        if len(req.devices) > MAX_DEVICES:
            raise InvalidArgument(f"{len(req.devices)} devices named {where}; at most {MAX_DEVICES}")
        if tuple(parse_devices(list(req.devices), "devices")) != tuple(req.devices):
            raise InvalidArgument(f"devices {req.devices!r} are not canonical names {where}; send cuda:N or fake:N")
        if req.world_size > 1:
            raise InvalidArgument(f"a job of {req.world_size} ranks keeps its devices (each rank its own, bound to "
                                  f"its collectives) {where}; name no devices for it (unset ROTA_DEVICES)")


__all__ = ["MAX_BYTES", "MAX_WEIGHT", "MAX_WORLD_SIZE", "OrchestratorConfig", "check_bytes",
           "check_request"]
