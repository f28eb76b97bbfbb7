"""Reading Slurm's view of jobs: the CLIs' ``--json`` output, or pyslurm where it fits.

Why the CLIs by default: pyslurm is built per Slurm release (PyPI's 25.11 refuses Slurm
22.05 and there is no 22.x wheel), while ``squeue --json`` works on 22.05 and later.
:func:`backend` picks pyslurm only when it imports and matches the running Slurm.

Which GPU a job got is not in 22.05's ``squeue --json``; it comes from
``scontrol -d show job`` (``GRES=gpu:1(IDX:0)``, ``GRES=shard:1(CNT:1/IDX:0)``...).
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
    group: str = ""  # the time-slice group (--timeslice), "" when none
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


def parse_gres_detail(text: str) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """Per-node GPU indexes of whole GPUs and of shards from ``scontrol -d show job`` output."""
    gpu: dict[str, set[int]] = {}
    shard: dict[str, set[int]] = {}
    for m in re.finditer(r"Nodes=(\S+)\s+CPU_IDs=\S+\s+Mem=\S+\s+GRES=(\S+)", text):
        node, gres = m.group(1), m.group(2)
        for kind, _count, idx in _GRES_IDX.findall(gres):
            (gpu if kind == "gpu" else shard).setdefault(node, set()).update(_expand(idx))
    return gpu, shard


def _group_of(comment_env: str) -> str:
    m = re.search(r"(?:^|\s)SPANK_ROTA_GROUP=(\S+)", comment_env)
    return m.group(1) if m else ""


class CliBackend:
    """``squeue --json`` plus ``scontrol -d show job`` for GRES indexes."""

    def jobs(self) -> list[SlurmJob]:
        data = json.loads(_run(["squeue", "--json"]))
        out = []
        for j in data.get("jobs", []):
            state = j.get("job_state", "")
            state = state[0] if isinstance(state, list) and state else str(state)
            job = SlurmJob(job_id=str(j.get("job_id")), name=j.get("name", ""), state=state,
                           nodes=j.get("nodes", ""), user=j.get("user_name", ""))
            if state in ("RUNNING", "COMPLETING", "SUSPENDED"):
                try:
                    detail = _run(["scontrol", "-d", "show", "job", job.job_id])
                except ConfigError as exc:
                    log.info("no GRES detail for job %s: %s", job.job_id, exc)
                    detail = ""
                job.gpu_idx, job.shard_idx = parse_gres_detail(detail)
            out.append(job)
        for job in out:
            job.group = job_groups().get(job.job_id, "")
        return out


def job_groups() -> dict[str, str]:
    """Job id -> time-slice group, from the SPANK job-control env Slurm keeps per job."""
    groups: dict[str, str] = {}
    try:
        text = _run(["scontrol", "show", "job", "-o"])
    except ConfigError:
        return groups
    for line in text.splitlines():
        m = re.search(r"JobId=(\d+)", line)
        if m is None:
            continue
        g = re.search(r"SPANK_ROTA_GROUP=([^\s,]+)", line)
        if g:
            groups[m.group(1)] = g.group(1)
    return groups


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
        groups = job_groups()
        for job in out:
            job.group = groups.get(job.job_id, "")
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
