"""slurm.conf / gres.conf lines for GPUs that several time-sliced tenants share.

Why shards: Slurm's ``shard`` GRES lets K jobs be placed on one GPU at the same time
(each gets the same CUDA_VISIBLE_DEVICES); rota then makes them take turns. A GPU
exposes ``tenants_per_gpu`` shards, so ``--gres=shard:1`` is "one tenant slot".

Slurm 22.05 caveat (seen on a real cluster): a whole-GPU job (``--gres=gpu:1``) can
be placed on a GPU whose shards are in use. :mod:`rota_slurm._status` detects that.
"""

from __future__ import annotations

from dataclasses import dataclass

from rota.errors import ConfigError


@dataclass(frozen=True)
class GresLayout:
    """GPUs of one node and how many tenants each may hold."""

    gpus: int
    shards_per_gpu: int
    device_glob: str = "/dev/nvidia"  # devices are f"{device_glob}{i}"

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ConfigError(f"--gpus must be at least 1, got {self.gpus}")
        if self.shards_per_gpu < 1:
            raise ConfigError(f"--tenants-per-gpu must be at least 1, got {self.shards_per_gpu}")

    @property
    def shards(self) -> int:
        return self.gpus * self.shards_per_gpu

    @property
    def gres_types(self) -> str:
        return "gpu,shard"

    @property
    def node_gres(self) -> str:
        """The ``Gres=`` value of the node line."""
        return f"gpu:{self.gpus},shard:{self.shards}"

    @property
    def files(self) -> str:
        return f"{self.device_glob}{0}" if self.gpus == 1 else f"{self.device_glob}[0-{self.gpus - 1}]"


def gres_conf(layout: GresLayout, *, autodetect: str = "off") -> str:
    """gres.conf: the GPUs and their shards, spread evenly (one ``shard`` line per GPU)."""
    lines = [f"AutoDetect={autodetect}", f"Name=gpu File={layout.files}"]
    lines += [f"Name=shard Count={layout.shards_per_gpu} File={layout.device_glob}{i}" for i in range(layout.gpus)]
    return "\n".join(lines) + "\n"


def node_line(name: str, layout: GresLayout, *, cpus: int = 0, memory_mb: int = 0, extra: str = "") -> str:
    """A slurm.conf ``NodeName=`` line advertising the GPUs and shards."""
    parts = [f"NodeName={name}"]
    if extra:
        parts.append(extra)
    if cpus:
        parts.append(f"CPUs={cpus}")
    if memory_mb:
        parts.append(f"RealMemory={memory_mb}")
    parts += [f"Gres={layout.node_gres}", "State=UNKNOWN"]
    return " ".join(parts)


def slurm_conf_lines(layout: GresLayout, node: str = "NODE") -> str:
    """The slurm.conf lines an admin adds (or merges) for time-sliced GPUs."""
    return "\n".join([
        f"GresTypes={layout.gres_types}",
        "SelectType=select/cons_tres",
        f"{node_line(node, layout)}   # merge Gres= into your existing NodeName line",
    ]) + "\n"
