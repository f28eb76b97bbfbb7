"""Who may act for which tenant: signed bearer tokens, and the checks every rota server makes.

rota is shared by teams that do not trust each other, so every call that acts for a job
(acquire, release, a session, an eviction) must prove it may. The proof is a JSON Web
Token (PyJWT, HS256) signed with the orchestrator's *auth key*, a secret file only the
orchestrator and the token issuers read (``rota token issue``, the Slurm prolog, the
Kubernetes controller). A token names what it may act for:

* a **tenant** token: one job of one group (``group=G, job=J``); a service that hosts
  many tenants of its own group (the Tinker service) gets ``job="*"``: any job of G;
* an **admin** token: any job of any group, eviction and the status of every group
  (schedulers' epilogs and controllers, operators).

A token has an *audience*, the kind of server that takes it: ``rota`` (orchestrators,
and node agents for their tenants) or ``rota-agent``, the tokens an orchestrator shows
its node agents. Those live at most ``AGENT_TOKEN_MAX_TTL_S``, the orchestrator
refuses them, and each names the one agent it is for (claim ``rota_agent``: the address
the orchestrator dials, ``--agent``), which an agent checks against the addresses it
answers to (``ServerAuth.agent_names``): whoever reads one off an agent link can act
neither at the orchestrator nor at another agent of the same key. A
tenant token may carry the highest priority its holder may ask for (``max_priority``,
``rota token issue --max-priority``); without one, priorities above 0 need an admin.

Tokens travel as ``authorization: Bearer <token>`` gRPC metadata, over TLS when the
server has a certificate (``--tls-cert``). They expire (default 24 h) and are never
echoed back: a refusal says what was wrong, not what was sent. A server with an auth
key checks them on every listener, Unix sockets included; a Unix socket of a server
without one (the embedded orchestrator's) admits only its owner: it is 0600 in a folder
only its owner (and root) can enter (:mod:`rota._tenant.local`).

No home-made crypto: signing and checking are PyJWT's; keys come from ``secrets``.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import secrets
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from rota._ids import check_id
from rota.errors import ConfigError, PermissionDenied, Unauthenticated

ALGORITHM = "HS256"
ISSUER = "rota"
AUDIENCE = "rota"
AGENT_AUDIENCE = "rota-agent"  # tokens an orchestrator shows node agents; refused by orchestrators
AGENT_TOKEN_MAX_TTL_S = 60.0
KEY_BYTES = 32
MAX_TOKEN_CHARS = 4096  # a longer "token" is refused before it is decoded
MAX_AGENT_CHARS = 512  # the agent address a rota-agent token names
DEFAULT_TTL_S = 24 * 3600.0
ANY_JOB = "*"
METADATA_KEY = "authorization"


@dataclass(frozen=True)
class Principal:
    """Who a verified credential speaks for."""

    group: str  # "" for an admin
    job: str  # a job id, ANY_JOB, or "" for an admin
    admin: bool = False
    subject: str = ""  # for logs: "admin", "job g/j", "uid 1000 (unix socket)"
    max_priority: int | None = None  # the highest priority a tenant token allows (None: 0)

    def may_act_for(self, group: str, job: str) -> bool:
        """True when this principal may acquire, release, attach or evict ``job`` of ``group``."""
        return self.admin or (group == self.group and self.job in (job, ANY_JOB))

    def may_see(self, group: str) -> bool:
        """True when this principal may read the status of ``group``."""
        return self.admin or group == self.group

    def check_priority(self, priority: int) -> None:
        """Raise :class:`PermissionDenied` when ``priority`` is above what this credential allows."""
        if self.admin or priority <= 0 or (self.max_priority is not None and priority <= self.max_priority):
            return
        allowed = 0 if self.max_priority is None else self.max_priority
        raise PermissionDenied(f"{self.subject or 'this credential'} may ask for priority {allowed} at most, not "
                               f"{priority}; use a token issued with `rota token issue --max-priority {priority}` "
                               "or an admin token")

    def require(self, group: str, job: str, action: str) -> None:
        """Raise :class:`PermissionDenied` unless this principal may do ``action`` for ``job`` of ``group``."""
        if not self.may_act_for(group, job):
            raise PermissionDenied(f"{self.subject or 'this credential'} may not {action} job {job!r} of group "
                                   f"{group!r}; use a token issued for that job (rota token issue --group {group} "
                                   f"--job {job}) or an admin token")


LOCAL_ADMIN = Principal("", "", admin=True, subject="the socket's owner")  # embedded Unix-socket orchestrator
INSECURE_ADMIN = Principal("", "", admin=True, subject="an unauthenticated caller (--insecure)")


@dataclass(frozen=True)
class ServerAuth:
    """How a rota server decides who is calling: a token, the socket's owner, or nobody checks.

    * ``key``: bearer tokens are verified with it; a call with a valid token is its principal;
    * ``local``: the server listens on a Unix socket in a directory only its owner can
      enter, so a caller without a token is the owner (admin);
    * ``insecure``: a TCP server started with ``--insecure``: a caller without a token is
      admin (what every server did before credentials existed; v1alpha1 peers need it).
    Otherwise a call without a token is refused (UNAUTHENTICATED).
    """

    key: bytes | None = None
    local: bool = False
    insecure: bool = False
    audiences: tuple[str, ...] = (AUDIENCE,)  # token audiences taken (a node agent also takes AGENT_AUDIENCE)
    agent_names: tuple[str, ...] = ()  # a node agent's addresses: a rota-agent token must name one of them

    def principal(self, metadata: Iterable[tuple[str, object]] | None) -> Principal:
        """The caller of a request with this gRPC ``metadata``."""
        token = token_from_metadata(metadata)
        if token:
            if self.key is None:
                if self.local or self.insecure:  # nothing to check it against; the caller is trusted anyway
                    return LOCAL_ADMIN if self.local else INSECURE_ADMIN
                raise Unauthenticated("this server has no auth key to check bearer tokens with")
            return verify(self.key, token, audiences=self.audiences, agent_names=self.agent_names)
        if self.local:
            return LOCAL_ADMIN
        if self.insecure:
            return INSECURE_ADMIN
        raise Unauthenticated("no bearer token: this server checks credentials; set ROTA_TOKEN (or pass token=) "
                              "to a token from `rota token issue`")


# --------------------------------------------------------------------------- keys


def generate_key(path: str) -> None:
    """Write a new random auth key to ``path`` (mode 0600; refuses to overwrite an existing file)."""
    data = base64.b64encode(secrets.token_bytes(KEY_BYTES)) + b"\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise ConfigError(f"auth key file {path!r} already exists; remove it first or use it as it is") from None
    except OSError as exc:
        raise ConfigError(f"cannot create auth key file {path!r}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def load_key(path: str) -> bytes:
    """Read an auth key; refuse a file others may read or own, a link, or a key too short to sign with."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ConfigError(f"auth key file {path!r} does not exist; create one with `rota token keygen {path}`") \
            from None
    except OSError as exc:
        raise ConfigError(f"cannot open auth key file {path!r} ({exc.strerror}); it must be a regular file, not a "
                          "symbolic link") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"auth key {path!r} is not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"auth key {path!r} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                              f"chmod 600 {path}")
        if st.st_uid not in (os.geteuid(), 0):  # whoever owns it knows the key and can mint any token
            raise ConfigError(f"auth key {path!r} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}) "
                              f"or root: its owner could issue any token; use a key of your own (rota token keygen "
                              "FILE) or chown it")
        raw = f.read(4096).strip()
    try:
        key = base64.b64decode(raw, validate=True)
    except ValueError:
        key = b""
    if len(key) < KEY_BYTES:
        raise ConfigError(f"auth key {path!r} is not a base64 key of at least {KEY_BYTES} bytes; create one with "
                          "`rota token keygen FILE`")
    return key


# --------------------------------------------------------------------------- tokens


def issue(key: bytes, *, group: str = "", job: str = "", admin: bool = False, ttl_s: float = DEFAULT_TTL_S,
          now: float | None = None, audience: str = AUDIENCE, max_priority: int | None = None,
          agent: str = "") -> str:
    """A token for ``job`` of ``group`` (``job="*"``: any job of the group), or an admin token, for servers of
    ``audience``; ``max_priority``: the highest priority the tenant may ask for (default 0); ``agent``: the
    address of the one agent a ``rota-agent`` token is for (required for that audience, refused for others)."""
    import jwt

    if ttl_s <= 0:
        raise ConfigError(f"token lifetime {ttl_s!r} s must be > 0")
    if audience not in (AUDIENCE, AGENT_AUDIENCE):
        raise ConfigError(f"token audience {audience!r} is not {AUDIENCE!r} or {AGENT_AUDIENCE!r}")
    if audience == AGENT_AUDIENCE and (not admin or ttl_s > AGENT_TOKEN_MAX_TTL_S):
        raise ConfigError(f"an {AGENT_AUDIENCE} token is an orchestrator's admin token for its node agents and lives "
                          f"at most {AGENT_TOKEN_MAX_TTL_S:g} s")
    if (audience == AGENT_AUDIENCE) != bool(agent) or not _agent_name_ok(agent or "x"):
        raise ConfigError(f"an {AGENT_AUDIENCE} token names the one agent it is for (agent=, the address the "
                          f"orchestrator dials, at most {MAX_AGENT_CHARS} printable characters), and only such a "
                          "token does")
    if max_priority is not None and (admin or not isinstance(max_priority, int) or not 0 <= max_priority <= 1000):
        raise ConfigError(f"max_priority {max_priority!r} must be a whole number 0..1000 on a tenant token (an "
                          "admin token may use any priority)")
    if admin:
        if group or job:
            raise ConfigError("an admin token names no group or job (it may act for all of them)")
    else:
        check_id("group", group, group_id=group)
        if job != ANY_JOB:
            check_id("job", job, job_id=job, group_id=group)
    t = time.time() if now is None else now
    claims = {"iss": ISSUER, "aud": audience, "iat": int(t), "exp": int(t + ttl_s),
              "rota_group": "" if admin else group, "rota_job": "" if admin else job, "rota_admin": bool(admin)}
    if max_priority is not None:
        claims["rota_max_priority"] = max_priority
    if agent:
        claims["rota_agent"] = agent
    return jwt.encode(claims, key, algorithm=ALGORITHM)


def _agent_name_ok(name: object) -> bool:
    return isinstance(name, str) and 0 < len(name) <= MAX_AGENT_CHARS and name.isprintable() and " " not in name


def verify(key: bytes, token: str, audiences: tuple[str, ...] = (AUDIENCE,),
           agent_names: tuple[str, ...] = ()) -> Principal:
    """The principal a token for one of ``audiences`` speaks for; :class:`Unauthenticated` (never quoting the
    token) if it is not valid. A ``rota-agent`` token must name one of ``agent_names`` (this agent's addresses)."""
    import jwt

    if not token or len(token) > MAX_TOKEN_CHARS:
        raise Unauthenticated("the bearer token is empty or too long")
    try:
        claims = jwt.decode(token, key, algorithms=[ALGORITHM], audience=list(audiences), issuer=ISSUER,
                            options={"require": ["exp", "iat", "iss", "aud"]})
    except jwt.ExpiredSignatureError:
        raise Unauthenticated("the bearer token has expired; issue a new one (rota token issue)") from None
    except jwt.InvalidAudienceError:
        raise Unauthenticated(f"the bearer token is for another kind of server (this one takes audience "
                              f"{' or '.join(audiences)}); use a token from `rota token issue`") from None
    except jwt.PyJWTError as exc:
        raise Unauthenticated(f"the bearer token is not valid here ({type(exc).__name__})") from None
    admin = claims.get("rota_admin") is True
    group, job = claims.get("rota_group", ""), claims.get("rota_job", "")
    if not isinstance(group, str) or not isinstance(job, str) or (not admin and not (group and job)):
        raise Unauthenticated("the bearer token names no group and job and is no admin token")
    if claims.get("aud") == AGENT_AUDIENCE and (not admin or not isinstance(claims["exp"], int)
                                                or not isinstance(claims["iat"], int)
                                                or claims["exp"] - claims["iat"] > AGENT_TOKEN_MAX_TTL_S):
        raise Unauthenticated(f"the bearer token of audience {AGENT_AUDIENCE} lives longer than "
                              f"{AGENT_TOKEN_MAX_TTL_S:g} s or is no admin token")
    if claims.get("aud") == AGENT_AUDIENCE and claims.get("rota_agent") not in agent_names:
        named = claims.get("rota_agent")  # signed with our key: the orchestrator's word, safe to show
        raise Unauthenticated(
            f"the bearer token of audience {AGENT_AUDIENCE} is for agent "
            f"{named if _agent_name_ok(named) else 'none'}, not this one (it answers to "
            f"{', '.join(agent_names) or 'no address'}); give the orchestrator's --agent the address this agent "
            "answers to, or start the agent with --name ADDRESS (the address the orchestrator dials)")
    cap = claims.get("rota_max_priority")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)):
        raise Unauthenticated("the bearer token's rota_max_priority is no whole number")
    return Principal(group, job, admin=admin, subject="admin token" if admin else f"token for job {group}/{job}",
                     max_priority=cap)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``token``."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def token_from_metadata(metadata: Iterable[tuple[str, object]] | None) -> str:
    """The bearer token in gRPC metadata, or "" when there is none."""
    for k, v in metadata or ():
        if k == METADATA_KEY:
            text = v.decode() if isinstance(v, bytes) else str(v)
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer":
                raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
            return token.strip()
    return ""


# --------------------------------------------------------------------------- channels


class _Details(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)
        self.metadata = metadata


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._metadata = list(bearer(token))

    def _with(self, details: grpc.ClientCallDetails) -> _Details:
        return _Details(details, [*(details.metadata or ()), *self._metadata])

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._with(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._with(details), requests)


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file a setting (``what``: a flag or env var) names; a clear error if unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be read ({exc.strerror}); give a PEM file") from None


def tls_credentials() -> grpc.ChannelCredentials | None:
    """Client TLS from the environment: ``ROTA_TLS_CA`` (the server's CA; turns TLS on) and, for
    servers that check clients (mTLS), ``ROTA_TLS_CERT`` + ``ROTA_TLS_KEY``. None when TLS is off."""
    ca = os.environ.get("ROTA_TLS_CA", "")
    cert, key = os.environ.get("ROTA_TLS_CERT", ""), os.environ.get("ROTA_TLS_KEY", "")
    if not ca:
        if cert or key:
            raise ConfigError("ROTA_TLS_CERT/ROTA_TLS_KEY are set but ROTA_TLS_CA is not; set ROTA_TLS_CA to the "
                              "server's CA certificate (PEM) to use TLS")
        return None
    if bool(cert) != bool(key):
        raise ConfigError("set both ROTA_TLS_CERT and ROTA_TLS_KEY (a client certificate and its key), or neither")
    return grpc.ssl_channel_credentials(root_certificates=read_pem(ca, "ROTA_TLS_CA"),
                                        private_key=read_pem(key, "ROTA_TLS_KEY") if key else None,
                                        certificate_chain=read_pem(cert, "ROTA_TLS_CERT") if cert else None)


def env_token() -> str:
    """``ROTA_TOKEN`` (the tenant's or operator's bearer token), or ""."""
    token = os.environ.get("ROTA_TOKEN", "").strip()
    if len(token) > MAX_TOKEN_CHARS:
        raise ConfigError(f"ROTA_TOKEN is {len(token)} characters long; a rota token is far shorter: set it to "
                          "what `rota token issue` printed")
    return token


def channel(target: str, *, token: str | None = None, options: Iterable[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to a rota server: TLS per :func:`tls_credentials` (not on a Unix socket), every call carrying
    ``token`` (default ``ROTA_TOKEN``), on a Unix socket too: a server with an auth key checks it there as well."""
    opts = list(options)
    creds = None if target.startswith("unix:") else tls_credentials()
    ch = grpc.secure_channel(target, creds, options=opts) if creds else grpc.insecure_channel(target, options=opts)
    token = env_token() if token is None else token
    return grpc.intercept_channel(ch, _Bearer(token)) if token else ch


def plaintext_beyond_loopback(endpoint: str) -> bool:
    """Whether a plaintext link to ``endpoint`` (``host:port``) leaves this host: not a Unix socket, not loopback."""
    if endpoint.startswith("unix:"):
        return False
    host = endpoint.rpartition(":")[0].strip("[]").lower()
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a host name: another host, as far as this link knows


def parse_ttl(text: str) -> float:
    """``90s``, ``30m``, ``24h``, ``7d`` or plain seconds, as seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    raw = text.strip().lower()
    scale = units.get(raw[-1:], None)
    number = raw[:-1] if scale else raw
    try:
        value = float(number) * (scale or 1)
    except ValueError:
        raise ConfigError(f"--ttl {text!r} is not a duration; use e.g. 90s, 30m, 24h or 7d") from None
    if not value > 0 or value > 366 * 86400:
        raise ConfigError(f"--ttl {text!r} must be more than 0 and at most a year")
    return value


__all__ = ["AGENT_AUDIENCE", "AGENT_TOKEN_MAX_TTL_S", "ANY_JOB", "AUDIENCE", "INSECURE_ADMIN", "LOCAL_ADMIN",
           "PermissionDenied", "Principal", "ServerAuth", "Unauthenticated", "bearer", "channel", "env_token",
           "generate_key", "issue", "load_key", "parse_ttl", "plaintext_beyond_loopback", "read_pem",
           "tls_credentials", "token_from_metadata", "verify"]
