"""Reach a pod's port through the API server, as ``kubectl port-forward`` does, with the kubernetes client.

``kubectl rota status`` uses it when no ``--orchestrator`` is given: :func:`ready_pod`
picks a ready orchestrator replica from the kubeconfig's cluster (any replica answers
status: followers read it from etcd), and :class:`PodForward` listens on a loopback
port and carries each connection over its own port-forward stream
(``kubernetes.stream.portforward``, the API server's ``pods/portforward``), so gRPC can
dial ``127.0.0.1:PORT``. The caller needs RBAC ``get``/``list`` on pods and ``create``
on ``pods/portforward`` in rota's namespace.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Any

from rota.errors import ConfigError

__all__ = ["PodForward", "api_unreachable", "ready_pod"]

log = logging.getLogger(__name__)
ORCHESTRATOR_SELECTOR = "app.kubernetes.io/name=rota-orchestrator,app.kubernetes.io/part-of=rota"
CHUNK = 64 * 1024


def ready_pod(api: Any, namespace: str, selector: str = ORCHESTRATOR_SELECTOR, *, timeout: float = 10.0) -> str:
    """Name of a Ready, running pod matching ``selector`` in ``namespace``; ConfigError saying why if none.

    An API server that refuses, or accepts and stays silent past ``timeout`` seconds, is
    one line naming its address and the settings that govern the wait.
    """
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        pods = api.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=timeout).items
    except ApiException as exc:
        raise ConfigError(f"cannot list pods in namespace {namespace!r} ({exc.status} {exc.reason}); is rota "
                          "installed there (--namespace), and may you list pods and create pods/portforward "
                          "there?") from None
    except (OSError, HTTPError) as exc:
        raise ConfigError(api_unreachable(api, exc, timeout)) from None
    if not pods:
        raise ConfigError(f"no rota orchestrator pod in namespace {namespace!r} ({selector}); give --namespace, "
                          "or --orchestrator HOST:PORT")
    for pod in pods:
        conditions = {c.type: c.status for c in (pod.status.conditions or [])}
        if pod.status.phase == "Running" and conditions.get("Ready") == "True" and not pod.metadata.deletion_timestamp:
            return pod.metadata.name
    names = ", ".join(p.metadata.name for p in pods)
    raise ConfigError(f"no orchestrator pod in namespace {namespace!r} is ready ({names}); see `kubectl -n "
                      f"{namespace} describe pod`")


def api_unreachable(api: Any, exc: BaseException, timeout: float) -> str:
    """One line for an API server that could not be asked: its address, the cause, what to change."""
    from urllib3.exceptions import MaxRetryError

    cfg = getattr(api, "configuration", None) or getattr(getattr(api, "api_client", None), "configuration", None)
    host = getattr(cfg, "host", "") or "?"
    cause = exc.reason if isinstance(exc, MaxRetryError) and exc.reason is not None else exc
    text = str(cause).split(": ", 1)[-1] if "Connection" in type(cause).__name__ else str(cause)
    if "timed out" in text.lower():
        text = f"no answer within {timeout:g} s"
    return (f"cannot reach the Kubernetes API server at {host} ({text[:200]}); check the cluster and "
            "--kubeconfig/--context, or wait longer with --timeout or ROTA_CONNECT_TIMEOUT_S")


class PodForward:
    """A loopback listener whose connections are carried to ``pod``:``port`` by the API server."""

    def __init__(self, api: Any, namespace: str, pod: str, port: int) -> None:
        self.api, self.namespace, self.pod, self.port = api, namespace, pod, port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"rota-portforward-{pod}", daemon=True)

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT`` to dial."""
        return f"127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> PodForward:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                local, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._carry, args=(local,), daemon=True).start()

    def _carry(self, local: socket.socket) -> None:
        from kubernetes.stream import portforward

        try:
            pf = portforward(self.api.connect_get_namespaced_pod_portforward, self.pod, self.namespace,
                             ports=str(self.port))
            remote = pf.socket(self.port)
        except Exception as exc:  # the API server refused: the client sees its connection closed
            log.error("port-forward to %s/%s:%d failed: %s", self.namespace, self.pod, self.port, exc)
            local.close()
            return
        remote.setblocking(True)
        back = threading.Thread(target=_pump, args=(remote, local), daemon=True)
        back.start()
        _pump(local, remote)
        back.join()
        pf.close()


def _pump(src: Any, dst: Any) -> None:
    """Copy ``src`` to ``dst`` until either ends; then end both (the other pump sees it)."""
    try:
        while chunk := src.recv(CHUNK):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
