"""rota_etcd's hook implementations, registered through the ``rota`` entry point."""

from __future__ import annotations

from rota.hookspecs import hookimpl
from rota_etcd._store import EtcdStore


@hookimpl
def rota_store(url: str) -> EtcdStore | None:
    """Serve ``--etcd http://HOST:PORT[,...]`` (and bare ``HOST:PORT`` lists)."""
    return EtcdStore(url)
