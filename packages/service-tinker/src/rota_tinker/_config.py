"""Service configuration: tenants (API key -> tenant), base models, devices, limits.

Read by :mod:`rota_tinker._http.service` (and built by :mod:`rota_tinker.cli` from flags
and environment variables). Everything is validated here, once, with errors that
name the bad value and say how to fix it, so the HTTP layer can trust it.

Environment variables (read by the CLI only): ``ROTA_TINKER_LISTEN``,
``ROTA_TINKER_KEYS`` (``TENANT=tml-KEY,...``), ``ROTA_TINKER_DEVICE``,
``ROTA_TINKER_DATA_DIR``, ``ROTA_TINKER_BASE_MODELS``, ``ROTA_TINKER_CAPACITY``, plus
rota's own ``ROTA_ORCHESTRATOR``/``ROTA_GROUP``/``ROTA_TOKEN``.

Names and ids are checked whole (``re.fullmatch``: a ``$`` also matches before a
trailing newline, which once let ``ok\n`` through as a file name).
"""

from __future__ import annotations

import hmac
import math
import os
import re
from dataclasses import dataclass, field

from rota.config import check_id
from rota.errors import ConfigError, RotaError
from rota_tinker._hf import HfModelSpec

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
KEY_PREFIX = "tml-"  # the SDK refuses any other API key prefix (tinker.lib._auth_token_provider)
_KEY = re.compile(r"tml-[A-Za-z0-9_-]{8,200}")


@dataclass(frozen=True)
class BaseModelSpec:
    """A small causal LM (no hub downloads): its shape, and its weights from ``seed`` or a local file.

    ``path``: a ``torch.save`` of the model's ``state_dict`` (``rota_tinker.save_base``
    writes one), loaded instead of random init; every tensor must match this shape.
    """

    name: str
    vocab: int = 128
    dim: int = 32
    layers: int = 2
    heads: int = 2
    max_len: int = 256
    seed: int = 0
    path: str | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ConfigError(f"base model name {self.name!r} is malformed: use letters, digits, '.', '_', '-' and "
                              "'/' (e.g. acme/lm-1b)")
        for attr in ("vocab", "dim", "layers", "heads", "max_len"):
            value = getattr(self, attr)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"base model {self.name!r}: {attr}={value!r} must be a positive integer")
        if not isinstance(self.seed, int):
            raise ConfigError(f"base model {self.name!r}: seed={self.seed!r} must be an integer")
        if self.dim % self.heads:
            raise ConfigError(f"base model {self.name!r}: dim={self.dim} must be a multiple of heads={self.heads}")
        if self.path is not None and not os.path.isfile(self.path):
            raise ConfigError(f"base model {self.name!r}: path={self.path!r} is not a file; give a torch.save'd "
                              "state_dict of this shape (rota_tinker.save_base writes one)")


    def params(self) -> int:
        """Parameters of the model (rota_tinker._worker.models.TinyLM): embeddings, blocks, final norm, unembedding."""
        d = self.dim
        return 2 * self.vocab * d + self.max_len * d + self.layers * (12 * d * d + 9 * d) + 2 * d

    def lora_params(self, rank: int, targets: dict[str, bool]) -> int:
        """Parameters of LoRA adapters of ``rank`` on ``targets`` (rota_tinker._worker.models.add_lora)."""
        d = self.dim
        per_layer = (4 * rank * 2 * d if targets.get("attn") else 0) + (10 * rank * d if targets.get("mlp") else 0)
        return self.layers * per_layer + (rank * (d + self.vocab) if targets.get("unembed") else 0)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
STATE_BYTES_PER_PARAM = 16  # fp32 weight, grad and two Adam moments
MAX_LORA_CONCURRENCY = 64  # LoRA units one shared turn runs at once (ServiceConfig.lora_concurrency)
_SPEC_INTS = ("vocab", "dim", "layers", "heads", "max_len", "seed")


def parse_base_model(text: str) -> BaseModelSpec:
    """``"NAME:vocab=32000,dim=2048,layers=8,heads=16[,max_len=..][,seed=..][,path=FILE]"`` -> a spec.

    Raises ConfigError naming the bad part.
    """
    name, sep, rest = text.strip().partition(":")
    if not sep or not name:
        raise ConfigError(f"base model {text!r} is not NAME:key=value,...; write e.g. "
                          "acme/lm:vocab=32000,dim=2048,layers=8,heads=16")
    fields: dict[str, object] = {}
    for item in (s.strip() for s in rest.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in (*_SPEC_INTS, "path"):
            raise ConfigError(f"base model {name!r}: {item!r} is not one of {', '.join(_SPEC_INTS)}, path as "
                              "key=value")
        if key == "path":
            fields[key] = value.strip()
            continue
        try:
            fields[key] = int(value)
        except ValueError:
            raise ConfigError(f"base model {name!r}: {key}={value!r} must be an integer") from None
    return BaseModelSpec(name.strip(), **fields)  # type: ignore[arg-type]


DEFAULT_BASE_MODELS: dict[str, BaseModelSpec] = {
    spec.name: spec
    for spec in (
        BaseModelSpec("rota/tiny", vocab=128, dim=32, layers=2, heads=2, seed=0),
        BaseModelSpec("rota/small", vocab=1024, dim=256, layers=4, heads=4, seed=0),
    )
}


@dataclass(frozen=True)
class Tenant:
    """One tenant of the service: its name (used in rota tenant ids) and its API key."""

    name: str
    api_key: str

    def __post_init__(self) -> None:
        if not _TENANT.fullmatch(self.name):
            raise ConfigError(f"tenant name {self.name!r} is malformed: use 1-63 letters, digits, '_' or '-', "
                              "starting with a letter or digit")
        if (not self.api_key.startswith(KEY_PREFIX) or len(self.api_key) < len(KEY_PREFIX) + 8
                or not _KEY.fullmatch(self.api_key)):
            raise ConfigError(f"API key of tenant {self.name!r} must start with {KEY_PREFIX!r} and have at least "
                              "8-200 more letters, digits, '-' or '_' (the tinker SDK refuses other keys)")
        why = key_weakness(self.api_key[len(KEY_PREFIX):], self.name)
        if why:  # never the key itself: it may be a real one, mistyped
            raise ConfigError(f"API key of tenant {self.name!r} is guessable ({why}); give every tenant a key of at "
                              f"least {KEY_BITS} random bits, e.g. the output of python -c \"import secrets; "
                              f"print('{KEY_PREFIX}' + secrets.token_urlsafe(32))\"")


KEY_BITS = 128  # the least an API key must carry: keys of 8 characters were guessed from many addresses (issue 45)
_KEY_CLASSES = ("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", "-_")


def key_weakness(body: str, tenant: str) -> str:
    """Why an API key (``body``: what follows ``tml-``) looks guessable, or ``""``. Its bits are estimated as
    its length times log2 of the characters of the classes it uses (lower, upper, digits, ``-_``); structure
    counts against it: the tenant's name inside it, words and numbers between separators
    (``alice-key-0123``), seven equal or consecutive characters in a row, few distinct characters. A key from
    ``secrets.token_urlsafe(32)`` (or ``token_hex(16)`` and longer) passes."""
    alphabet = sum(len(c) for c in _KEY_CLASSES if any(ch in c for ch in body))
    bits = len(body) * math.log2(max(alphabet, 2))
    if bits < KEY_BITS:
        return f"{len(body)} characters after {KEY_PREFIX!r} of {alphabet} kinds carry about {bits:.0f} bits"
    if len(tenant) >= 3 and tenant.lower() in body.lower():
        return "it holds the tenant's name"
    parts = [p for p in re.split(r"[-_]", body) if p]
    if len(parts) >= 2 and all((p.isalpha() and p.islower()) or p.isdigit() for p in parts):
        return "it is words and numbers between separators"
    for i in range(len(body) - 6):
        steps = {ord(b) - ord(a) for a, b in zip(body[i:i + 6], body[i + 1:i + 7], strict=True)}
        if len(steps) == 1 and steps <= {-1, 0, 1}:
            return "it has seven equal or consecutive characters in a row"
    if len(set(body)) < min(8, len(body) // 4):
        return f"it has only {len(set(body))} distinct characters"
    return ""


def parse_keys(text: str) -> list[Tenant]:
    """``"alice=tml-...,bob=tml-..."`` -> tenants; raises ConfigError naming the bad item."""
    tenants = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, key = item.partition("=")
        if not sep:
            raise ConfigError(f"tenant entry {item.split('=')[0]!r}... is not TENANT=KEY; write e.g. alice=tml-...")
        tenants.append(Tenant(name.strip(), key.strip()))
    return tenants


@dataclass(frozen=True)
class ServiceConfig:
    """What :class:`rota_tinker.TinkerService` serves and where its workers run."""

    tenants: tuple[Tenant, ...]
    data_dir: str
    device: str = "cpu"
    group: str = "tinker"
    # rota orchestrator HOST:PORT (workers present ROTA_TOKEN, a token for job "*" of group); None: the service
    # runs its own on a Unix socket in a 0700 directory of its own, which no other user can reach
    endpoint: str | None = None
    # what tenants may train on: Hugging Face models by hub name (rota_tinker.find_models) and/or test specs
    base_models: dict[str, BaseModelSpec | HfModelSpec] = field(default_factory=lambda: dict(DEFAULT_BASE_MODELS))
    model_dirs: tuple[str, ...] = ()  # the directories searched for base_models (named when a model is not found)
    long_poll_s: float = 10.0  # retrieve_future waits this long before answering try_again
    max_body_bytes: int = 64 * 1024 * 1024
    worker_start_timeout_s: float = 120.0
    torch_threads: int = 1
    # LoRA tenants on one base share one resident copy held by a base-holder process
    # (rota_tinker._worker.holder); False gives every LoRA worker its own copy (for comparisons).
    share_lora_base: bool = True
    # A tenant's work units already queued when one finishes run in the same rota turn, up to
    # this many: forward_backward and the optim_step behind it cost one switch, not two.
    units_per_turn: int = 4
    # LoRA units on one shared base that may run at once, in one shared rota turn of that base
    # (rota_tinker._worker.shared_turn): each still computes exactly what it would alone; 1 gives every LoRA
    # tenant exclusive turns. Needs share_lora_base.
    lora_concurrency: int = 1
    # Every tenant's LoRA models on a shared base in one worker, their queued units run as one batched pass
    # (rota_tinker._worker.batch); lora_batch_tokens bounds one model's tokens in one pass. Needs share_lora_base.
    lora_batch: bool = False
    lora_batch_tokens: int = 16384
    # After a park, hand the tenant's cached device memory back (torch.cuda.empty_cache) so other
    # tenants' processes can use it; False keeps it (no re-allocation next turn) when all working sets fit.
    release_cached: bool = True
    # Workers use torch's deterministic algorithms (and cuBLAS's fixed workspace): on CUDA a run alone and the same
    # run time-sliced beside others then give bit-identical losses (CPU is deterministic already), a little slower.
    deterministic: bool = False
    stop_timeout_s: float = 30.0  # stop(): how long workers (then holders) get to exit before they are killed
    # Device bytes the tenants' working sets may take together (shared bases aside). > 0: the service's
    # own orchestrator knows this capacity, so tenants that fit stay resident between turns
    # (a turn then moves nothing) and only the oldest are parked when the next one does not fit.
    # 0: every switch parks the previous holder. Needs endpoint None (an external orchestrator has
    # its own --capacity).
    capacity_bytes: int = 0
    # Finished futures are forgotten this long after they finish (their results were fetched, or never will be).
    future_ttl_s: float = 900.0
    # Per-key quotas (past one, a request is refused with 429 saying which and how to free some): live models,
    # live sessions (training and sampling), and bytes (model state, 16 per trainable parameter plus 4 per
    # parameter of a private base, and saved sampler weights on disk).
    max_models: int = 8
    max_sessions: int = 64
    max_bytes: int = 64 * 2**30
    # Per key, what the HTTP process holds for it (rota_tinker._http.budget): work units not finished yet (queued or
    # running), and bytes of results reserved or not yet fetched; a fetched result is let go result_grace_s after
    # its first answer (a client whose connection broke may fetch it again meanwhile).
    max_queued_units: int = 256
    max_result_bytes: int = 4 * 2**30
    result_grace_s: float = 30.0
    # A session without a heartbeat (the SDK sends one every 10 s) for this long ends: its models are unloaded.
    session_ttl_s: float = 300.0
    # stop(): for up to this long, answer the live sessions' heartbeats with 410 (session ended) before closing,
    # so their SDKs stop heart-beating instead of warning every 10 s forever; 0 closes at once.
    farewell_s: float = 0.0
    # HTTP front end (uvicorn): open connections at most; the head of each request must arrive within
    # header_timeout_s and its body within body_timeout_s; handlers run on http_threads threads; JSON bodies
    # are at most max_json_bytes (forward_backward protobuf bodies: max_body_bytes).
    max_connections: int = 2048
    # ... of which one peer address may hold max_client_connections, and those that have not shown a known API key
    # yet at most max_unauthenticated (and half of max_connections), oldest closed first (rota_tinker._http.gate).
    max_client_connections: int = 256
    max_unauthenticated: int = 1024
    # ... and those that have shown one tenant's API key at most max_key_connections (and a quarter of
    # max_connections): a tenant holding many half-sent requests, from many addresses, keeps only its own out.
    max_key_connections: int = 256
    # HTTPS: the certificate and private key (PEM files); "" serves plain HTTP.
    tls_cert: str = ""
    tls_key: str = ""
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    http_threads: int = 16
    max_json_bytes: int = 8 * 1024 * 1024
    # Tokens one forward/forward_backward request may carry over all its data (400 past it): one huge request
    # would hold the device for its whole turn. The SDK is told (client config) to split batches below it.
    max_request_tokens: int = 131072

    def __post_init__(self) -> None:
        if not self.tenants:
            raise ConfigError("no tenants configured: give at least one --tenant NAME=tml-KEY (or ROTA_TINKER_KEYS)")
        names = [t.name for t in self.tenants]
        keys = [t.api_key for t in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError(f"tenant names repeat in {names}; give each tenant one entry")
        if len(set(keys)) != len(keys):
            raise ConfigError("two tenants share one API key; every tenant needs its own key")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device {self.device!r} not understood; use cpu, cuda or cuda:N")
        if not 0.05 <= self.long_poll_s <= 40:
            raise ConfigError(f"long_poll_s={self.long_poll_s} must be within [0.05, 40] (the SDK waits 45 s)")
        if self.torch_threads < 1:
            raise ConfigError(f"torch_threads={self.torch_threads} must be >= 1")
        if not self.base_models:
            raise ConfigError("no base models configured")
        if not isinstance(self.units_per_turn, int) or self.units_per_turn < 1:
            raise ConfigError(f"units_per_turn={self.units_per_turn!r} must be an integer >= 1 (1: a turn per unit)")
        if not self.stop_timeout_s > 0:
            raise ConfigError(f"stop_timeout_s={self.stop_timeout_s!r} must be > 0 seconds")
        if not isinstance(self.release_cached, bool):
            raise ConfigError(f"release_cached={self.release_cached!r} must be True or False")
        if not isinstance(self.share_lora_base, bool):
            raise ConfigError(f"share_lora_base={self.share_lora_base!r} must be True or False")
        if (not isinstance(self.lora_concurrency, int) or isinstance(self.lora_concurrency, bool)
                or not 1 <= self.lora_concurrency <= MAX_LORA_CONCURRENCY):
            raise ConfigError(f"lora_concurrency={self.lora_concurrency!r} must be an integer in [1, "
                              f"{MAX_LORA_CONCURRENCY}] (1: exclusive turns for every LoRA tenant)")
        if self.lora_concurrency > 1 and not self.share_lora_base:
            raise ConfigError(f"lora_concurrency={self.lora_concurrency} runs LoRA units together on a shared base, "
                              "but share_lora_base is off (--no-share-base): drop one of the two")
        if not isinstance(self.lora_batch, bool):
            raise ConfigError(f"lora_batch={self.lora_batch!r} must be True or False")
        if self.lora_batch and (not self.share_lora_base or self.lora_concurrency > 1):
            raise ConfigError("lora_batch (--lora-batch) trains LoRA models together on the shared base: it needs "
                              "share_lora_base (drop --no-share-base) and replaces the shared LoRA turn (drop "
                              f"--lora-concurrency {self.lora_concurrency})")
        if (not isinstance(self.lora_batch_tokens, int) or isinstance(self.lora_batch_tokens, bool)
                or not 1 <= self.lora_batch_tokens <= 1 << 20):
            raise ConfigError(f"lora_batch_tokens={self.lora_batch_tokens!r} must be an integer in [1, {1 << 20}]")
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes < 0:
            raise ConfigError(f"capacity_bytes={self.capacity_bytes!r} must be an integer >= 0 (0: park on every "
                              "switch)")
        if self.capacity_bytes and self.endpoint:
            raise ConfigError(f"capacity_bytes={self.capacity_bytes} needs the service's own orchestrator, but "
                              f"endpoint={self.endpoint!r} names an external one: give that one --capacity "
                              "(rota orchestrator serve --capacity) and drop the service's")
        if not self.future_ttl_s > 0:
            raise ConfigError(f"future_ttl_s={self.future_ttl_s!r} must be > 0 seconds")
        try:
            check_id("group", self.group)
        except RotaError as e:
            raise ConfigError(f"{e}; fix --group / ROTA_GROUP") from None
        for name in ("max_models", "max_sessions", "max_bytes", "max_connections", "max_client_connections",
                     "max_unauthenticated", "max_key_connections", "http_threads", "max_json_bytes", "max_body_bytes",
                     "max_request_tokens", "max_queued_units", "max_result_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("give --tls-cert and --tls-key together (the certificate and its private key)")
        for path in (self.tls_cert, self.tls_key):
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"TLS file {path!r} cannot be read; give a PEM file (--tls-cert / --tls-key)")
        if not 0 <= self.result_grace_s <= 3600:
            raise ConfigError(f"result_grace_s={self.result_grace_s!r} must be 0-3600 seconds (--result-grace)")
        for name in ("session_ttl_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be > 0 seconds")
        if not 0 <= self.farewell_s <= 60:
            raise ConfigError(f"farewell_s={self.farewell_s!r} must be 0-60 seconds (--farewell; the SDK heart-beats "
                              "every 10 s)")
        bad = [k for k, spec in self.base_models.items() if k != spec.name]
        if bad:
            raise ConfigError(f"base_models keys {bad} differ from their specs' names; key each spec by its name")

    def tenant_for_key(self, key: bytes) -> Tenant | None:
        """The tenant of API key ``key`` (raw header bytes); every key is compared in constant time."""
        found = None
        for t in self.tenants:
            if hmac.compare_digest(t.api_key.encode(), key):
                found = t
        return found
