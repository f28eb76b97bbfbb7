"""``rota slurm ...``: install the SPANK plugin, render GRES config, submit, status, epilog.

Each command is a thin layer over a library function in this package; user mistakes
become one-line click errors. Added to ``rota`` by :func:`rota_slurm.plugin.rota_cli`.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import click

from rota import auth
from rota.admin import client_timeout
from rota.cli.options import Endpoint
from rota.config import MAX_PRIORITY, MIN_PRIORITY, check_endpoint
from rota.errors import RotaError
from rota_slurm import _groups, _orchestrator, _place, _slurm, _spank, _status, _token
from rota_slurm._conf import GresLayout, gres_conf, slurm_conf_lines

log = logging.getLogger(__name__)

DEFAULT_LIB_DIR = "/usr/local/lib/rota"


@click.group("slurm")
def slurm() -> None:
    """rota on Slurm: `sbatch --timeslice=GROUP`, GRES shards, group status."""


@slurm.command("install-spank")
@click.option("--plugstack", type=click.Path(dir_okay=False, path_type=Path),
              help="Add (or replace) rota's line in this plugstack.conf. Default: print the line.")
@click.option("--orchestrator", type=Endpoint(), default=None, envvar="ROTA_ORCHESTRATOR",
              help="Orchestrator address jobs get as ROTA_ORCHESTRATOR (env ROTA_ORCHESTRATOR). Without it, "
              "each node's jobs use that node's embedded orchestrator.")
@click.option("--dest", type=click.Path(path_type=Path), default=DEFAULT_LIB_DIR, show_default=True,
              help="Directory (or .so path) for the compiled plugin; must be readable on every node.")
@click.option("--rota", "rota_exe", default="", help="rota executable the job epilog runs (default: this one).")
@click.option("--auth-key", type=click.Path(dir_okay=False), default="",
              help="The orchestrator's auth key (rota token keygen; mode 0600, on every node): each job step gets "
              "ROTA_TOKEN for its own job, the epilog an admin token. Without it jobs get no token.")
@click.option("--tls-ca", type=click.Path(dir_okay=False), default="",
              help="The orchestrator's TLS CA certificate: jobs and the epilog get ROTA_TLS_CA.")
@click.option("--max-priority", type=click.IntRange(0, 1000), default=0, show_default=True,
              help="The highest --timeslice-priority a job's token may carry (with --auth-key, the orchestrator "
              "refuses a priority above its token's): a job asking more gets no token and its step fails.")
@click.option("--include-dir", multiple=True, help="Extra -I directory holding slurm/spank.h.")
@click.option("--optional", is_flag=True, help="Mark the plugin optional: jobs still run if it fails to load.")
def install_spank(plugstack: Path | None, orchestrator: str | None, dest: Path, rota_exe: str, auth_key: str,
                  tls_ca: str, max_priority: int, include_dir: tuple[str, ...], optional: bool) -> None:
    """Compile the SPANK plugin against slurm/spank.h and print or write its plugstack.conf line."""
    try:
        if auth_key:
            auth.load_key(auth_key)  # refuses a key others may read, now rather than in every job
            auth_key = os.path.abspath(auth_key)
        so = _spank.build(dest, include_dirs=include_dir)
        line = _spank.PlugstackLine(so, orchestrator=orchestrator or "",
                                    rota=rota_exe or _spank.default_rota_executable(), required=not optional,
                                    python=sys.executable, auth_key=auth_key,
                                    tls_ca=os.path.abspath(tls_ca) if tls_ca else "", max_priority=max_priority)
        text = line.render()
    except RotaError as exc:
        raise click.ClickException(str(exc)) from None
    if not orchestrator:
        log.warning("no --orchestrator: jobs on each node share that node's embedded orchestrator only, and the "
                    "job epilog evicts nothing")
    elif not auth_key:
        log.warning("no --auth-key: jobs get no token, so the orchestrator must run with --insecure")
    if plugstack is None:
        click.echo(text)
        return
    _spank.write_plugstack(plugstack, line)
    click.echo(f"built {so}; wrote to {plugstack}: {text}", err=True)
    click.echo("slurm.conf needs PlugStackConfig pointing there (default /etc/slurm/plugstack.conf); "
               "restart slurmd on every node (scontrol reconfigure is not enough for slurmd).", err=True)


@slurm.command("conf")
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="GPUs per node.")
@click.option("--tenants-per-gpu", type=click.IntRange(min=1), required=True,
              help="Time-sliced tenants one GPU may hold (its shard count).")
@click.option("--node", default="NODE", show_default=True, help="Node name for the NodeName= line.")
@click.option("--device-prefix", default="/dev/nvidia", show_default=True, help="GPU device files are PREFIX0...")
def conf(gpus: int, tenants_per_gpu: int, node: str, device_prefix: str) -> None:
    """Print the gres.conf and slurm.conf lines for GPUs shared by time-sliced tenants."""
    layout = GresLayout(gpus=gpus, shards_per_gpu=tenants_per_gpu, device_glob=device_prefix)
    click.echo("# --- gres.conf ---")
    click.echo(gres_conf(layout), nl=False)
    click.echo("# --- slurm.conf ---")
    click.echo(slurm_conf_lines(layout, node), nl=False)
    click.echo(f"# tenants then ask for: sbatch --timeslice=%n-%g --gres=shard:1 (one group per GPU set; up to "
               f"{layout.shards} per node)")


@slurm.command("submit", context_settings={"ignore_unknown_options": True})
@click.option("--group", required=True, help="Time-slice group the tenants share; %n is the node name and %g "
              "the job's GPUs there (e.g. '%n-%g': one group per GPU set of a node).")
@click.option("--tenants", type=click.IntRange(min=1), default=1, show_default=True, help="How many jobs to submit.")
@click.option("--node", default="", help="Pin every tenant to this node (one group = one GPU set).")
@click.option("--shards", type=click.IntRange(min=1), default=1, show_default=True, help="Shards per tenant.")
@click.option("--priority", type=click.IntRange(MIN_PRIORITY, MAX_PRIORITY), default=0,
              help=f"--timeslice-priority of every tenant ({MIN_PRIORITY}..{MAX_PRIORITY}, the orchestrator's range).")
@click.option("--force", is_flag=True, help="Submit even if a whole-GPU job shares a GPU with shard tenants.")
@click.option("--dry-run", is_flag=True, help="Print the sbatch commands, do not run them.")
@click.argument("sbatch_args", nargs=-1, type=click.UNPROCESSED, required=True)
def submit(group: str, tenants: int, node: str, shards: int, priority: int, force: bool, dry_run: bool,
           sbatch_args: tuple[str, ...]) -> None:
    """Submit TENANTS jobs that share one GPU via --gres=shard and --timeslice=GROUP.

    Everything after `--` goes to sbatch (e.g. `-- -o out-%j.txt train.sh`). One job id
    per line is printed.
    """
    try:
        args = _place.sbatch_args(group, shards=shards, node=node, priority=priority)
    except RotaError as exc:
        raise click.BadParameter(str(exc), param_hint="--group") from None
    if not dry_run and not force:
        try:
            problems = _status.conflicts(_slurm.backend().jobs())
        except RotaError as exc:
            raise click.ClickException(str(exc)) from None
        if node:
            problems = [p for p in problems if p.node == node]
        if problems:
            raise click.ClickException("refusing to submit (use --force to override): "
                                       + "; ".join(p.message() for p in problems))
    for _ in range(tenants):
        cmd = ["sbatch", "--parsable", *args, *sbatch_args]
        if dry_run:
            click.echo(" ".join(cmd))
            continue
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise click.ClickException(f"sbatch failed: {exc}") from None
        if res.returncode != 0:
            raise click.ClickException(f"sbatch failed: {res.stderr.strip()}")
        click.echo(res.stdout.strip().split(";")[0])


@slurm.command("status")
@click.option("--orchestrator", "endpoint", type=Endpoint(), envvar="ROTA_ORCHESTRATOR", default=None,
              help="Orchestrator address (env ROTA_ORCHESTRATOR). Default: the orchestrator= of rota's line in "
              "plugstack.conf (PlugStackConfig of $SLURM_CONF).")
@click.option("--group", default="", help="Only this group.")
@click.option("--backend", type=click.Choice(["cli", "pyslurm", "auto"]), default=None,
              help="How to read Slurm's jobs (default cli; env ROTA_SLURM_BACKEND).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds to wait for the orchestrator's answer (default: ROTA_CONNECT_TIMEOUT_S, else 10).")
def status(endpoint: str | None, group: str, backend: str | None, as_json: bool, timeout: float | None) -> None:
    """Slurm jobs joined with their time-slice group: who holds, who waits, job state.

    An orchestrator started with --auth-key answers an admin token only: set ROTA_TOKEN
    (`rota token issue --auth-key KEY --admin`).
    """
    if endpoint is None:
        path = _spank.plugstack_path()
        endpoint = _spank.read_plugstack(path).get("orchestrator", "")
        if not endpoint:
            raise click.UsageError(f"no --orchestrator and no orchestrator= on rota's line in {path}; pass "
                                   "--orchestrator HOST:PORT or install the plugin with `rota slurm install-spank "
                                   "--orchestrator HOST:PORT`")
    try:
        groups = _orchestrator.group_status(endpoint, group, client_timeout(timeout))
        jobs = _slurm.backend(backend or "").jobs()
    except RotaError as exc:
        raise click.ClickException(str(exc)) from None
    rows = _status.join(jobs, groups)
    if group:
        rows = [r for r in rows if r.group == group]
    problems = _status.conflicts(jobs)
    if as_json:
        click.echo(json.dumps({"jobs": [asdict(r) for r in rows], "conflicts": [asdict(c) for c in problems]},
                              indent=2))
    else:
        click.echo(_status.render(rows, problems))
    for p in problems:
        log.warning("%s", p.message())


@slurm.command("quickstart")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--orchestrator", type=Endpoint(), envvar="ROTA_ORCHESTRATOR", required=True,
              help="The orchestrator jobs use (env ROTA_ORCHESTRATOR), e.g. 127.0.0.1:50051.")
@click.option("--auth-key", type=click.Path(exists=True, dir_okay=False), default="",
              help="The orchestrator's auth key: jobs get their own ROTA_TOKEN, the epilog an admin token.")
@click.option("--gpus", type=click.IntRange(1, 16), default=2, show_default=True, help="Fake GPUs of the node.")
@click.option("--tenants-per-gpu", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Shards per GPU: tenants that may share one.")
def quickstart(folder: Path, orchestrator: str, auth_key: str, gpus: int, tenants_per_gpu: int) -> None:
    """Run a throw-away one-node Slurm cluster with rota's plugin in FOLDER, until Ctrl-C.

    For trying rota on Slurm on any Linux machine, GPUs or not: its own munged,
    slurmctld and slurmd (loopback ports, nothing system-wide touched), --gpus fake GPU
    devices with shards (jobs get CUDA_VISIBLE_DEVICES; torch then finds no CUDA and
    uses the CPU), and the SPANK plugin built from this package. Needs root and the
    Debian/Ubuntu packages munge slurmctld slurmd slurm-client libslurm-dev gcc.
    """
    import signal
    import threading

    from rota_slurm.testing import SlurmCluster, missing_binaries

    missing = missing_binaries()
    if missing:
        raise click.ClickException(f"not installed: {', '.join(missing)}; on Debian/Ubuntu: apt-get install munge "
                                   "slurmctld slurmd slurm-client libslurm-dev gcc")
    if os.geteuid() != 0:
        raise click.ClickException("the cluster needs root (slurmd starts jobs as their users; the fake GPUs are "
                                   "made with mknod): run it with sudo")
    if auth_key:
        try:
            auth.load_key(auth_key)
        except RotaError as exc:
            raise click.UsageError(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = SlurmCluster(folder.resolve(), nodes=("n1",), gpus_per_node=gpus, shards_per_gpu=tenants_per_gpu,
                           cpus_per_node=max(2, os.cpu_count() or 2), orchestrator=orchestrator,
                           auth_key=str(Path(auth_key).resolve()) if auth_key else "")
    try:
        cluster.start()
    except (RuntimeError, TimeoutError, OSError) as exc:
        cluster.stop()
        raise click.ClickException(f"the cluster did not start: {exc}") from None
    rota = shlex.quote(str(Path(sys.argv[0]).resolve())) if Path(sys.argv[0]).name == "rota" else "rota"
    admin = (f"\n  export ROTA_TOKEN=$({rota} token issue --auth-key {shlex.quote(str(Path(auth_key).resolve()))} "
             "--admin --ttl 12h)  # rota slurm status asks as an admin" if auth_key else "")
    python = shlex.quote(sys.executable)
    click.echo(f"""rota quickstart: one-node Slurm cluster up ({gpus} fake GPUs x {tenants_per_gpu} shards), jobs use \
the orchestrator at {orchestrator}. In another shell:

  export SLURM_CONF={cluster.conf}{admin}
  sbatch --timeslice=g0 --gres=shard:1 --wrap '{python} -c "import rota; g = rota.connect(); g.acquire(); print(1)"'
  {rota} slurm status

Ctrl-C stops the cluster; logs are in {cluster.root / 'log'}.""", err=False)
    sys.stdout.flush()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        cluster.stop()
        click.echo("rota quickstart: cluster stopped", err=True)


@slurm.command("check")
@click.option("--backend", type=click.Choice(["cli", "pyslurm", "auto"]), default=None,
              help="How to read Slurm's jobs: cli (squeue/scontrol), pyslurm, or auto (pyslurm if it loads, else cli). "
              "Default cli; env ROTA_SLURM_BACKEND.")
def check(backend: str | None) -> None:
    """Exit 1 if a whole-GPU job shares a GPU with shard tenants (a Slurm 22.05 placement)."""
    try:
        problems = _status.conflicts(_slurm.backend(backend or "").jobs())
    except RotaError as exc:
        raise click.ClickException(str(exc)) from None
    for p in problems:
        click.echo(f"CONFLICT: {p.message()}")
    if problems:
        sys.exit(1)
    click.echo("ok: no whole-GPU job shares a GPU with time-sliced tenants")


def _env(*names: str) -> str:
    """The first of ``names`` that is set and non-empty in the environment."""
    return next((os.environ[n] for n in names if os.environ.get(n)), "")


@slurm.command("token")
@click.option("--auth-key", type=click.Path(dir_okay=False), required=True, help="The orchestrator's auth key.")
@click.option("--group", required=True, help="The job's time-slice group (expanded: no %n/%g).")
@click.option("--job", required=True, help="The Slurm job id.")
@click.option("--max-ttl", default=_token.DEFAULT_MAX_TTL, show_default=True,
              help="Longest lifetime; a job's token lives as long as the job may still run, plus 10 minutes.")
def token(auth_key: str, group: str, job: str, max_ttl: str) -> None:
    """Print the token the SPANK plugin gives JOB of GROUP (ROTA_TOKEN): valid for that job only."""
    try:
        click.echo(_token.job_token(auth_key, group, job, max_ttl_s=auth.parse_ttl(max_ttl),
                                    left_s=_token.time_left(job)))
    except RotaError as exc:
        raise click.ClickException(str(exc)) from None


@slurm.command("epilog")
@click.option("--job", default=lambda: os.environ.get("SLURM_JOB_ID", ""),
              help="Slurm job id (default $SLURM_JOB_ID).")
@click.option("--group", default=lambda: _env("SPANK_ROTA_GROUP", "SLURM_SPANK_ROTA_GROUP"),
              help="Time-slice group (default $SPANK_ROTA_GROUP, set by the SPANK plugin).")
@click.option("--orchestrator", "endpoint", type=Endpoint(), default=None,
              help="Orchestrator (default: orchestrator= of rota's line in plugstack.conf; never the environment, "
              "which the job's user controls).")
@click.option("--auth-key", type=click.Path(dir_okay=False), default=None,
              help="Evict with an admin token made from this key (default: auth_key= in plugstack.conf, else "
              "$ROTA_TOKEN).")
@click.option("--plugstack", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="plugstack.conf to read (default: PlugStackConfig of $SLURM_CONF's slurm.conf).")
@click.option("--timeout", type=float, default=15.0, show_default=True, help="Give up after this many seconds.")
def epilog(job: str, group: str, endpoint: str | None, auth_key: str | None, plugstack: Path | None,
           timeout: float) -> None:
    """Release JOB's turn and drop it from GROUP's queue (the job ended or was cancelled).

    Run by the SPANK plugin at the end of every --timeslice job; usable as (part of) a
    Slurm Epilog= script too. A job without a group is a no-op. %n in GROUP is this
    node ($SLURMD_NODENAME); with %g (the GPU set of each step), the job leaves every
    group of the orchestrator that GROUP can name and that knows the job.

    It runs as root with an environment the job's user shaped (SPANK_*), so the
    orchestrator, and the key its admin token is made from, come from the command line
    or plugstack.conf only; without an orchestrator there, nothing is evicted (exit 0,
    so the node is not drained) and the reason is logged.
    """
    if not group:
        return
    if endpoint is None or auth_key is None:
        path = plugstack or _spank.plugstack_path()
        args = _spank.read_plugstack(path)
        endpoint = endpoint or args.get("orchestrator", "")
        auth_key = args.get("auth_key", "") if auth_key is None else auth_key
        if not endpoint:
            log.warning("epilog of job %s: no --orchestrator and no orchestrator= in %s; nothing evicted (the job's "
                        "environment is never trusted to name the orchestrator)", job, path)
            click.echo(f"job {job}: not evicted: no orchestrator= in {path}", err=True)
            return
        try:
            endpoint = check_endpoint(endpoint, f"orchestrator= in {path}")
        except RotaError as exc:
            raise click.ClickException(str(exc)) from None
    if not job:
        raise click.ClickException("epilog needs a job id: pass --job or set SLURM_JOB_ID")
    try:
        # an admin token for this one call; without a key, the site's own ROTA_TOKEN (or none: --insecure)
        token = auth.issue(auth.load_key(auth_key), admin=True, ttl_s=timeout + 60) if auth_key else None
    except RotaError as exc:
        raise click.ClickException(f"epilog of job {job}: {exc}") from None
    node = os.environ.get("SLURMD_NODENAME", "")
    if "%n" in group and not node:
        raise click.ClickException(f"group {group!r} names the node (%n) but SLURMD_NODENAME is unset: run this "
                                   "on the job's node, or pass the expanded --group")
    group = _groups.expand_node(group, node)
    reason = f"slurm job {job} ended"
    try:
        if "%g" in group:
            results = _orchestrator.evict_matching(endpoint, job, _groups.pattern_regex(group), reason=reason,
                                                   timeout=timeout, token=token)
        else:
            results = {group: _orchestrator.evict(endpoint, job, group, reason=reason, timeout=timeout, token=token)}
    except RotaError as exc:
        raise click.ClickException(f"evict of job {job} from group {group} failed: {exc}") from None
    if not results:
        click.echo(f"job {job} was in no group matching {group}")
    for name, result in results.items():
        if result.gone:
            click.echo(f"job {job} was already gone: the orchestrator has no group {name}")
            continue
        log.info("job %s left group %s (was holder: %s, was queued: %s)", job, name, result.was_holder,
                 result.was_queued)
        click.echo(f"job {job} left group {name} (holder={result.was_holder}, queued={result.was_queued})")
