"""Joining Slurm's job list with the orchestrator's groups, and the shard/GPU guard.

Tenants of a Slurm time-slice group are named by their Slurm job id (the SPANK plugin
sets ``ROTA_TENANT=$SLURM_JOB_ID``), so the join is on that id.

The guard: Slurm 22.05 may place a whole-GPU job (``--gres=gpu:1``) on a GPU whose
shards are already given to time-sliced tenants; then a job that expects a dedicated
GPU shares it with tenants that rota does not know about. :func:`conflicts` finds such
pairs from the GRES indexes of running jobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from rota_slurm._slurm import SlurmJob


@dataclass(frozen=True)
class Row:
    """One line of ``rota slurm status``."""

    job_id: str
    name: str
    slurm_state: str
    nodes: str
    group: str
    turn: str  # holding, waiting, resident, parked, lost, idle, or "-" when not in a group


@dataclass(frozen=True)
class Conflict:
    """A whole-GPU job and a shard job placed on the same GPU of one node."""

    node: str
    gpu: int
    whole_gpu_job: str
    shard_job: str

    def message(self) -> str:
        return (f"job {self.whole_gpu_job} (--gres=gpu) and shard job {self.shard_job} share GPU {self.gpu} "
                f"on node {self.node}: Slurm placed a whole-GPU job on a time-sliced GPU")


def join(jobs: list[SlurmJob], groups: list) -> list[Row]:
    """Rows for every Slurm job plus tenants the orchestrator knows that Slurm no longer lists."""
    by_job: dict[str, tuple[str, str]] = {}
    for g in groups:
        for t in g.tenants:
            state = "holding" if g.holder == t.job_id else ("waiting" if t.job_id in g.queue else t.state)
            by_job[t.job_id] = (g.group_id, state)
    rows = []
    seen = set()
    for j in jobs:
        group, turn = by_job.get(j.job_id, (j.group, "-"))
        rows.append(Row(j.job_id, j.name, j.state, j.nodes, group or "-", turn))
        seen.add(j.job_id)
    for job_id, (group, turn) in sorted(by_job.items()):
        if job_id not in seen and turn in ("holding", "waiting"):
            rows.append(Row(job_id, "?", "GONE", "-", group, turn))
    return rows


def conflicts(jobs: list[SlurmJob]) -> list[Conflict]:
    """Whole-GPU jobs placed on a GPU that shard jobs use (same node, same index)."""
    out = []
    for a in jobs:
        for node, idx in a.gpu_idx.items():
            for b in jobs:
                if b.job_id == a.job_id:
                    continue
                for gpu in sorted(idx & b.shard_idx.get(node, set())):
                    out.append(Conflict(node, gpu, a.job_id, b.job_id))
    return out


def render(rows: list[Row], problems: list[Conflict]) -> str:
    """Plain-text table for ``rota slurm status``."""
    lines = [f"{'JOBID':<10} {'NAME':<16} {'STATE':<11} {'NODES':<10} {'GROUP':<16} TURN"]
    lines += [f"{r.job_id:<10} {r.name[:16]:<16} {r.slurm_state:<11} {r.nodes:<10} {r.group:<16} {r.turn}"
              for r in rows]
    lines += [f"WARNING: {c.message()}" for c in problems]
    return "\n".join(lines)
