"""``rota token``: make an auth key and issue bearer tokens for tenants and operators."""

from __future__ import annotations

import click

from rota import auth
from rota.errors import RotaError

__all__ = ["issue", "keygen", "token"]


@click.group()
def token() -> None:
    """Credentials for an orchestrator started with --auth-key FILE.

    \b
    rota token keygen /etc/rota/auth.key                  # once, on the orchestrator's host (mode 0600)
    rota token issue --auth-key /etc/rota/auth.key --group gpu0 --job ppo-1 > ppo-1.token
    ROTA_TOKEN=$(cat ppo-1.token) python train.py         # the job may act for gpu0/ppo-1 only

    A tenant token acts for one job of one group (--job '*': any job of the group, for a
    service hosting many); --admin acts for every job and sees every group (schedulers'
    epilogs and controllers, operators). Anyone holding the key can issue tokens: keep it
    readable by the orchestrator and the token issuers only.
    """


@token.command("keygen")
@click.argument("path", type=click.Path(dir_okay=False))
def keygen(path: str) -> None:
    """Write a new random auth key to PATH (0600; an existing file is never overwritten)."""
    try:
        auth.generate_key(path)
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"wrote a new auth key to {path} (mode 0600)", err=True)


@token.command("issue")
@click.option("--auth-key", "key_path", required=True, type=click.Path(dir_okay=False), envvar="ROTA_AUTH_KEY",
              help="The orchestrator's auth key file (env ROTA_AUTH_KEY).")
@click.option("--group", default="", help="The group the token may act in.")
@click.option("--job", default="", help="The job it may act for; '*' = any job of --group.")
@click.option("--admin", is_flag=True, help="Act for every job of every group (no --group/--job).")
@click.option("--ttl", default="24h", show_default=True, help="Lifetime: 90s, 30m, 24h, 7d.")
@click.option("--max-priority", type=click.IntRange(0, 1000), default=None,
              help="The highest priority the job may ask for (0..1000). Without it the token allows priority 0 "
              "and below; higher priorities need an admin token.")
def issue(key_path: str, group: str, job: str, admin: bool, ttl: str, max_priority: int | None) -> None:
    """Print a bearer token; give it to the job as ROTA_TOKEN."""
    if not admin and not (group and job):
        raise click.UsageError("give --group and --job (the tenant the token acts for), or --admin")
    if admin and max_priority is not None:
        raise click.UsageError("--max-priority bounds a tenant token; an admin token may use any priority")
    try:
        click.echo(auth.issue(auth.load_key(key_path), group=group, job=job, admin=admin, ttl_s=auth.parse_ttl(ttl),
                              max_priority=max_priority))
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
