"""rota on Slurm: ``sbatch --timeslice=GROUP`` and GPU shards shared by time-sliced jobs.

An admin installs three things (see the package README, section "Slurm")::

    rota slurm install-spank --plugstack /etc/slurm/plugstack.conf --orchestrator orch:50051 \
        --auth-key /etc/rota/auth.key
    rota slurm conf --gpus 8 --tenants-per-gpu 4      # GRES lines for gres.conf/slurm.conf
    systemctl restart slurmctld slurmd

then users submit tenants that share a GPU and take turns on it::

    sbatch --timeslice=g0 --gres=shard:1 train.sh     # inside: gpu = rota.connect()

The SPANK plugin (C, built by ``install-spank`` against the cluster's ``slurm/spank.h``)
validates the options at submit time, sets ROTA_GROUP, ROTA_TENANT (the job id),
ROTA_ORCHESTRATOR, ROTA_TOKEN (a token for this job only, issued as root from the auth
key), and in steps of several tasks ROTA_RANK and ROTA_WORLD_SIZE in the job, and when
the job ends or is cancelled calls ``rota slurm epilog``, which evicts it from its group
at the orchestrator named in plugstack.conf (never one the job's environment names).
``--timeslice=%n-%g`` names the group after the node and the GPUs the job's GRES sit on
(``n1-gpu0_1``): one group per GPU set.
"""

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time each loads on first use, so
    # that loading the plugin (rota --help) imports none of them
    from rota_slurm._conf import GresLayout, gres_conf, node_line, slurm_conf_lines
    from rota_slurm._orchestrator import EvictResult, evict, group_status
    from rota_slurm._place import place, sbatch_args
    from rota_slurm._spank import PlugstackLine, build, write_plugstack
    from rota_slurm._status import Conflict, conflicts

__all__ = [
    "Conflict", "EvictResult", "GresLayout", "PlugstackLine", "build", "conflicts", "evict", "gres_conf",
    "group_status", "node_line", "place", "sbatch_args", "slurm_conf_lines", "write_plugstack",
]


_HOME = {
    "GresLayout": "rota_slurm._conf",
    "gres_conf": "rota_slurm._conf",
    "node_line": "rota_slurm._conf",
    "slurm_conf_lines": "rota_slurm._conf",
    "EvictResult": "rota_slurm._orchestrator",
    "evict": "rota_slurm._orchestrator",
    "group_status": "rota_slurm._orchestrator",
    "place": "rota_slurm._place",
    "sbatch_args": "rota_slurm._place",
    "PlugstackLine": "rota_slurm._spank",
    "build": "rota_slurm._spank",
    "write_plugstack": "rota_slurm._spank",
    "Conflict": "rota_slurm._status",
    "conflicts": "rota_slurm._status",
}
__getattr__ = lazy_getattr(__name__, _HOME)
