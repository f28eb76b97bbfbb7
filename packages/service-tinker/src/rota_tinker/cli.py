"""``rota tinker serve`` (``rota serve tinker`` is a hidden alias): run the Tinker-compatible service in the foreground.

Flags fall back to environment variables: ``ROTA_TINKER_LISTEN``, ``ROTA_TINKER_KEYS``
(``TENANT=tml-KEY,...``), ``ROTA_TINKER_DEVICE``, ``ROTA_TINKER_DATA_DIR``,
``ROTA_TINKER_BASE_MODELS`` (space-separated specs), ``ROTA_TINKER_CAPACITY``,
``ROTA_ORCHESTRATOR`` (a served rota orchestrator, whose token the workers take from
``ROTA_TOKEN``; unset: the service's own, on a Unix socket only its uid can reach),
``ROTA_GROUP``.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import tempfile
from collections.abc import Callable

import click

from rota.cli.options import ByteSize
from rota.errors import RotaError
from rota_tinker._config import MAX_LORA_CONCURRENCY

log = logging.getLogger(__name__)


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8000)", param_hint="--listen")
    return host, int(port)


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# (flag, ServiceConfig field, type, default, help): per-key quotas and the HTTP front end's bounds
_LIMITS = (
    ("--max-models", "max_models", click.IntRange(min=1), 8,
     "Models one API key may hold at once (429 past it; unload_model or closing a session frees)."),
    ("--max-sessions", "max_sessions", click.IntRange(min=1), 64,
     "Live sessions (training and sampling) one API key may hold at once (429 past it)."),
    ("--max-bytes", "max_bytes", ByteSize(), "64GiB",
     "Bytes of model state and saved weights one API key may hold (429 past it)."),
    ("--max-queued-units", "max_queued_units", click.IntRange(min=1), 256,
     "Work units (forward_backward, optim_step, samples, saves...) one API key may have queued or running at once "
     "(429 past it)."),
    ("--max-result-bytes", "max_result_bytes", ByteSize(), "4GiB",
     "Bytes of results one API key may have reserved (a unit's largest possible result, from when it is accepted) "
     "or not yet fetched (429 past it; a single request whose result could take more: 400)."),
    ("--result-grace", "result_grace_s", click.FloatRange(min=0, max=3600), 30.0,
     "Seconds a result is kept after its first answer (a client whose connection broke fetches it again), then "
     "let go."),
    ("--session-ttl", "session_ttl_s", click.FloatRange(min=1), 300.0,
     "Seconds without a heartbeat after which a session ends and its models are unloaded."),
    ("--farewell", "farewell_s", click.FloatRange(min=0, max=60), 12.0,
     "On stop (Ctrl-C, SIGTERM), seconds to keep answering live sessions' heartbeats with 410 (session ended) "
     "so their SDKs stop heart-beating quietly; stops sooner once each has had its answer. 0: stop at once."),
    ("--max-connections", "max_connections", click.IntRange(min=1), 2048,
     "Open HTTP connections at most (503 past it)."),
    ("--max-client-connections", "max_client_connections", click.IntRange(min=1), 256,
     "Open HTTP connections one peer address may hold (more are closed at once)."),
    ("--max-unauthenticated", "max_unauthenticated", click.IntRange(min=1), 1024,
     "Open connections that have not shown a known API key yet, in all (at most half of --max-connections); one "
     "more closes the oldest, so slow or keyless clients cannot keep tenants out."),
    ("--max-key-connections", "max_key_connections", click.IntRange(min=1), 256,
     "Open connections that show one tenant's API key, at most (and a quarter of --max-connections); more are "
     "closed once their request head arrives, so one tenant cannot hold the places the others need."),
    ("--header-timeout", "header_timeout_s", click.FloatRange(min=0.1), 10.0,
     "Seconds a request's head (request line and headers) may take to arrive; then the connection is closed."),
    ("--body-timeout", "body_timeout_s", click.FloatRange(min=0.1), 60.0,
     "Seconds a request's body may take to arrive (408 past it)."),
    ("--max-request-tokens", "max_request_tokens", click.IntRange(min=1), 131072,
     "Tokens one forward/forward_backward request may carry over all its data (400 past it); the tinker SDK is "
     "told to split its batches below this."),
)


def _limit_options(fn: Callable[..., None]) -> Callable[..., None]:
    """Add the options of :data:`_LIMITS`, each passed to the command under its ServiceConfig field name."""
    for flag, name, kind, default, text in reversed(_LIMITS):
        fn = click.option(flag, name, type=kind, default=default, show_default=True, help=text)(fn)
    return fn


@click.command("serve")
@click.option("--listen", default="127.0.0.1:8000", show_default=True, envvar="ROTA_TINKER_LISTEN",
              help="HOST:PORT to serve HTTP on (env ROTA_TINKER_LISTEN).")
@click.option("--tls-cert", default="", type=click.Path(dir_okay=False), envvar="ROTA_TINKER_TLS_CERT",
              help="Serve HTTPS with this certificate (PEM; env ROTA_TINKER_TLS_CERT). Without it API keys travel in "
                   "the clear: a --listen beyond loopback then prints a warning.")
@click.option("--tls-key", default="", type=click.Path(dir_okay=False), envvar="ROTA_TINKER_TLS_KEY",
              help="The private key of --tls-cert (PEM; env ROTA_TINKER_TLS_KEY).")
@click.option("--tenant", "tenants", multiple=True, envvar="ROTA_TINKER_KEYS",
              help="NAME=tml-KEY; repeat per tenant (env ROTA_TINKER_KEYS, comma-separated).")
@click.option("--device", default="cpu", show_default=True, envvar="ROTA_TINKER_DEVICE",
              help="Device of every worker: cpu, cuda or cuda:N (env ROTA_TINKER_DEVICE).")
@click.option("--model-dir", "model_dirs", multiple=True, envvar="ROTA_TINKER_MODEL_DIRS",
              type=click.Path(exists=True, file_okay=False),
              help="A directory of Hugging Face model snapshots (hub cache models--ORG--NAME/snapshots/REV, or plain "
                   "folders ORG/NAME with config.json and *.safetensors): every causal LM in it is served under its "
                   "hub name. Repeat per directory (env ROTA_TINKER_MODEL_DIRS, ':'-separated); the hub cache "
                   "(HF_HUB_CACHE, else HF_HOME/hub) is searched too. Nothing is downloaded.")
@click.option("--base-model", "base_models", multiple=True, envvar="ROTA_TINKER_BASE_MODELS",
              help="A small test transformer tenants may train on, as NAME:vocab=V,dim=D,layers=L,heads=H[,max_len=N]"
                   "[,seed=S][,path=FILE] (FILE: a torch.save'd state_dict of that shape, loaded instead of "
                   "random init from SEED). Repeat per model (env ROTA_TINKER_BASE_MODELS, space-separated). "
                   "Without these and without any Hugging Face model found: rota/tiny and rota/small.")
@click.option("--group", default="tinker", show_default=True, envvar="ROTA_GROUP",
              help="rota group the workers share (env ROTA_GROUP).")
@click.option("--orchestrator", default=None, envvar="ROTA_ORCHESTRATOR",
              help="A served rota orchestrator HOST:PORT (env ROTA_ORCHESTRATOR); the workers present ROTA_TOKEN, a "
                   "token for job '*' of --group (rota token issue --group G --job '*'). Unset: the service runs "
                   "its own on a Unix socket in a 0700 directory, which no other user can reach.")
@click.option("--capacity", type=ByteSize(), default="0", show_default=True, envvar="ROTA_TINKER_CAPACITY",
              help="Device bytes the tenants' working sets may take together, shared bases aside (e.g. 120GiB). "
                   "Set: the service runs its own orchestrator, tenants that fit stay resident between turns and "
                   "only the oldest are parked when one more does not fit. 0: every switch parks the previous "
                   "holder. Not with --orchestrator (give that one --capacity).")
@click.option("--units-per-turn", type=click.IntRange(min=1), default=4, show_default=True,
              help="A tenant's queued work units that may share one turn (1: a turn per unit).")
@click.option("--keep-cache/--release-cache", default=False, show_default=True,
              help="After a park, keep the tenant's CUDA cache (no re-allocation next turn) or hand it back so "
                   "other tenants' processes can use it.")
@click.option("--deterministic", is_flag=True, default=False,
              help="Workers use torch's deterministic algorithms: on CUDA a tenant's losses are then bit-identical "
                   "whether it runs alone or beside others (a little slower).")
@click.option("--share-base/--no-share-base", default=True, show_default=True,
              help="LoRA tenants of one base model share one resident copy (a base-holder process) or load "
                   "their own.")
@click.option("--lora-concurrency", type=click.IntRange(1, MAX_LORA_CONCURRENCY), default=1, show_default=True,
              help="LoRA units on one shared base that may run at once, in one shared rota turn of that base: a "
                   "LoRA step leaves the device idle while Python launches its kernels, so a few run beside each "
                   "other at little cost to each. Each still computes exactly what it would alone; its adapters "
                   "then stay on the device (never parked). 1: every LoRA tenant takes exclusive turns.")
@click.option("--lora-batch/--no-lora-batch", default=False, show_default=True, envvar="ROTA_TINKER_LORA_BATCH",
              help="Train every tenant's LoRA models on one shared base in one process, their queued "
                   "forward_backward units as one batched pass (the base's matmuls once over all their tokens, "
                   "each tenant's adapters on its own rows, its own loss and AdamW): many tenants cost one CUDA "
                   "context and one set of activations. Adapters stay on the device. Needs --share-base; "
                   "excludes --lora-concurrency > 1.")
@click.option("--lora-batch-tokens", type=click.IntRange(1, 1 << 20), default=16384, show_default=True,
              help="With --lora-batch: the most tokens of one model in one batched pass. A larger request is cut "
                   "by datum and runs over consecutive passes, so it cannot starve the others.")
@click.option("--data-dir", default=None, envvar="ROTA_TINKER_DATA_DIR",
              help="Where sampler weights are written (env ROTA_TINKER_DATA_DIR; default: a temp dir).")
@click.option("--long-poll", type=float, default=10.0, show_default=True,
              help="Seconds retrieve_future waits before answering try_again.")
@click.option("--worker-start-timeout", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="Seconds a tenant's worker process may take to start (torch import, CUDA init, the base).")
@_limit_options
def serve_cmd(listen: str, tls_cert: str, tls_key: str, tenants: tuple[str, ...], device: str,
              model_dirs: tuple[str, ...], base_models: tuple[str, ...], group: str,
              orchestrator: str | None, capacity: int, units_per_turn: int, keep_cache: bool, deterministic: bool,
              share_base: bool, lora_concurrency: int, lora_batch: bool, lora_batch_tokens: int,
              data_dir: str | None, long_poll: float, worker_start_timeout: float, **limits: float) -> None:
    """Serve the tinker SDK's training and sampling API; each API key is a tenant.

    \b
    rota tinker serve --tenant alice=$ALICE_KEY --tenant bob=$BOB_KEY --device cuda:0 \\
        --model-dir /models --capacity 120GiB
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=$ALICE_KEY python my_loop.py
    (each key: tml- and at least 128 random bits, e.g. secrets.token_urlsafe(32); others are refused)
    """
    from rota_tinker._config import DEFAULT_BASE_MODELS, ServiceConfig, parse_base_model, parse_keys
    from rota_tinker._hf import find_models, search_dirs
    from rota_tinker._http.service import TinkerService

    host, port = _listen(listen)
    try:
        parsed = [t for item in tenants for t in parse_keys(item)]
        specs = [parse_base_model(text) for text in base_models]
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise click.BadParameter(f"base model names repeat in {names}; give each model one --base-model",
                                     param_hint="--base-model")
        dirs = search_dirs([d for item in model_dirs for d in item.split(":") if d])
        models: dict = {**find_models(dirs), **{s.name: s for s in specs}}
        if not models:
            log.warning("no Hugging Face causal LM found in %s; serving the test models %s", dirs,
                        sorted(DEFAULT_BASE_MODELS))
            models = dict(DEFAULT_BASE_MODELS)
        config = ServiceConfig(tenants=tuple(parsed), data_dir=data_dir or tempfile.mkdtemp(prefix="rota-tinker-"),
                               device=device, group=group, endpoint=orchestrator or None, long_poll_s=long_poll,
                               base_models=models, model_dirs=tuple(dirs),
                               capacity_bytes=capacity, units_per_turn=units_per_turn, release_cached=not keep_cache,
                               share_lora_base=share_base, deterministic=deterministic,
                               lora_concurrency=lora_concurrency, lora_batch=lora_batch,
                               lora_batch_tokens=lora_batch_tokens,
                               worker_start_timeout_s=worker_start_timeout, tls_cert=tls_cert, tls_key=tls_key,
                               **limits)  # type: ignore[arg-type]
    except RotaError as e:
        raise click.UsageError(str(e)) from e
    try:
        service = TinkerService(config, host, port)
    except RotaError as e:
        raise click.UsageError(str(e)) from e
    except OSError as e:
        raise click.ClickException(f"cannot listen on {listen}: {e}") from e
    if not tls_cert and not _loopback(host):
        click.echo(f"rota tinker: WARNING: serving plain HTTP on {host}, beyond loopback: API keys and data travel "
                   "in the clear; give --tls-cert/--tls-key", err=True)
    turns = (f"orchestrator {service.endpoint}" if orchestrator else
             f"own orchestrator {service.endpoint}" + (f", capacity {capacity / 2**30:.1f} GiB" if capacity else ""))
    click.echo(f"rota tinker: serving {service.url} for tenants {[t.name for t in config.tenants]} on {device}, "
               f"base models {sorted(config.base_models)}, {turns} (TINKER_BASE_URL={service.url})", err=True)
    # uvicorn stops serving on SIGINT/SIGTERM, then raises the signal again: make SIGTERM end here too, so the
    # workers are stopped and the private orchestrator's directory removed (SIGINT is KeyboardInterrupt already)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        service.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()


@click.group()
def tinker() -> None:
    """A Tinker-API-compatible training service whose tenants take turns on GPUs."""


tinker.add_command(serve_cmd)


@click.group("serve", hidden=True)
def serve() -> None:
    """Run a service whose tenants take turns on GPUs (``rota serve tinker``, an alias of ``rota tinker serve``)."""


serve.add_command(serve_cmd, name="tinker")
