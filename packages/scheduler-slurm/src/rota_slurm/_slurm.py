"""Reading Slurm's view of jobs: the CLIs' ``--json`` output, or pyslurm where it fits.

Why the CLIs by default: pyslurm is built per Slurm release (PyPI's 25.11 refuses Slurm
22.05 and there is no 22.x wheel), while ``squeue --json`` works on 22.05 and later.
:func:`backend` picks pyslurm only when it imports and matches the running Slurm.

Which GPU a job got is in ``gres_detail`` (``gpu:1(IDX:0)``, ``shard:1(IDX:0)``), one
entry per allocated node. A job's time-slice group is not visible to Slurm's CLIs; it is
joined from the orchestrator, whose tenants are named by Slurm job id.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Protocol

from rota.errors import ConfigError

log = logging.getLogger(__name__)

_GRES_IDX = re.compile(r"(gpu|shard)(?::[^:(,]+)?:(\d+)\((?:CNT:\d+/)?IDX:([0-9,\-]+)\)")


@dataclass
class SlurmJob:
    """What rota needs to know about one Slurm job."""

    job_id: str
    name: str
    state: str
    nodes: str
    user: str = ""
    group: str = ""  # the time-slice group, filled from the orchestrator when known
    gpu_idx: dict[str, set[int]] = field(default_factory=dict)  # node -> whole-GPU indexes
    shard_idx: dict[str, set[int]] = field(default_factory=dict)  # node -> GPU indexes of its shards


class Backend(Protocol):
    """A way to list jobs (CLI or pyslurm)."""

    def jobs(self) -> list[SlurmJob]: ...


def _run(args: list[str], timeout: float = 30.0) -> str:
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise ConfigError(f"{args[0]} not found: install the Slurm client (Debian: slurm-client)") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{' '.join(args)} did not answer within {timeout:.0f} s") from None
    if res.returncode != 0:
        raise ConfigError(f"{' '.join(args)} failed: {res.stderr.strip() or res.returncode}")
    return res.stdout


def _expand(idx: str) -> set[int]:
    out: set[int] = set()
    for part in idx.split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out.update(range(int(a), int(b) + 1))
        elif part:
            out.add(int(part))
    return out


def parse_gres_detail(nodes: list[str], details: list[str]) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """Per-node GPU indexes of whole GPUs and of shards from squeue's ``gres_detail``.

    ``details[i]`` (e.g. ``gpu:1(IDX:0)``, ``shard:2(CNT:2/IDX:1)``) belongs to ``nodes[i]``.
    """
    gpu: dict[str, set[int]] = {}
    shard: dict[str, set[int]] = {}
    for node, gres in zip(nodes, details, strict=False):
        for kind, _count, idx in _GRES_IDX.findall(gres):
            (gpu if kind == "gpu" else shard).setdefault(node, set()).update(_expand(idx))
    return gpu, shard


def _job_from_json(j: dict) -> SlurmJob:
    state = j.get("job_state", "")
    state = state[0] if isinstance(state, list) and state else str(state)
    job = SlurmJob(job_id=str(j.get("job_id")), name=j.get("name", ""), state=state, nodes=j.get("nodes", ""),
                   user=j.get("user_name", ""))
    alloc = (j.get("job_resources") or {}).get("allocated_nodes") or []
    names = [n.get("nodename", "") for n in alloc] or [job.nodes]
    job.gpu_idx, job.shard_idx = parse_gres_detail(names, list(j.get("gres_detail") or []))
    return job


class CliBackend:
    """``squeue --json`` (22.05 and later): state, nodes and GRES indexes (``gres_detail``)."""

    def jobs(self) -> list[SlurmJob]:
        data = json.loads(_run(["squeue", "--json"]))
        return [_job_from_json(j) for j in data.get("jobs", [])]


class PyslurmBackend:
    """pyslurm's job list (only where pyslurm matches the cluster's Slurm)."""

    def __init__(self) -> None:
        import pyslurm  # noqa: F401  - optional dependency, checked by backend()

    def jobs(self) -> list[SlurmJob]:
        import pyslurm

        out = []
        for job in pyslurm.Jobs.load().values():
            out.append(SlurmJob(job_id=str(job.id), name=job.name or "", state=str(job.state),
                                nodes=job.nodes or "", user=job.user_name or ""))
        return out


def backend(name: str = "") -> Backend:
    """``cli`` (default), ``pyslurm``, or ``auto`` (env ROTA_SLURM_BACKEND): pyslurm if it loads."""
    name = name or os.environ.get("ROTA_SLURM_BACKEND", "cli")
    if name == "cli":
        return CliBackend()
    if name in ("pyslurm", "auto"):
        try:
            return PyslurmBackend()
        except Exception as exc:  # ImportError, or pyslurm refusing this Slurm release
            if name == "pyslurm":
                raise ConfigError(f"pyslurm is not usable here ({exc}); pip install pyslurm matching your Slurm "
                                  "release, or use --backend cli") from None
            log.info("pyslurm not usable (%s); using the Slurm CLIs", exc)
            return CliBackend()
    raise ConfigError(f"unknown Slurm backend {name!r}: use cli, pyslurm or auto")
