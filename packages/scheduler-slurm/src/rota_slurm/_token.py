"""Each Slurm job's token: what the SPANK plugin puts in the job's env as ROTA_TOKEN.

The plugin runs this as root in slurmstepd, before privileges are dropped, once per step
and node (``python -I -m rota_slurm._token --auth-key KEY --group G --job J``), so the
auth key stays readable by root only. The token acts for job J of group G and nothing
else, and lives as long as the job may still run (``squeue %L``) plus a margin, at most
``--max-ttl``; a job without a time limit gets ``--max-ttl``. On success only the token
is printed (the plugin checks that); on failure one line saying why, exit status 1.

A module of its own, light to import: it runs before every step of every time-sliced job.
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys

from rota import auth
from rota.errors import RotaError

log = logging.getLogger(__name__)

MARGIN_S = 600.0  # the epilog and clock skew between nodes
DEFAULT_MAX_TTL = "30d"
_LEFT = re.compile(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)")


def parse_time_left(text: str) -> float | None:
    """Seconds from squeue's ``%L`` (``1-02:03:04``, ``02:03:04``, ``3:04``); None for UNLIMITED and the like."""
    match = _LEFT.fullmatch(text.strip())
    if match is None:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def time_left(job: str, timeout: float = 10.0) -> float | None:
    """Seconds job ``job`` may still run, from squeue; None if unlimited or unknown (logged)."""
    try:
        res = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True,
                             timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("squeue for job %s failed (%s): its token gets the longest lifetime", job, exc)
        return None
    lines = res.stdout.split()
    if res.returncode != 0 or len(lines) != 1:
        log.warning("squeue -j %s answered %r: its token gets the longest lifetime", job, res.stdout[:100])
        return None
    return parse_time_left(lines[0])


def job_token(key_path: str, group: str, job: str, *, max_ttl_s: float, left_s: float | None,
              max_priority: int | None = None) -> str:
    """A token for ``job`` of ``group`` valid for ``left_s`` plus the margin, at most ``max_ttl_s``, allowing
    priorities up to ``max_priority`` (the plugin passes the job's own, once plugstack.conf allowed it)."""
    ttl = max_ttl_s if left_s is None else min(left_s + MARGIN_S, max_ttl_s)
    return auth.issue(auth.load_key(key_path), group=group, job=job, ttl_s=ttl, max_priority=max_priority)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rota_slurm._token", description=__doc__.split("\n\n")[0])
    parser.add_argument("--auth-key", required=True, help="the orchestrator's auth key file (mode 0600)")
    parser.add_argument("--group", required=True, help="the job's time-slice group on this node, expanded")
    parser.add_argument("--job", required=True, help="the Slurm job id")
    parser.add_argument("--max-ttl", default=DEFAULT_MAX_TTL, help=f"longest lifetime (default {DEFAULT_MAX_TTL})")
    parser.add_argument("--max-priority", type=int, default=None, help="the highest priority the job may ask for")
    args = parser.parse_args(argv)
    try:
        token = job_token(args.auth_key, args.group, args.job, max_ttl_s=auth.parse_ttl(args.max_ttl),
                          left_s=time_left(args.job), max_priority=args.max_priority)
    except RotaError as exc:
        print(f"rota: {exc}", flush=True)
        return 1
    print(token, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
