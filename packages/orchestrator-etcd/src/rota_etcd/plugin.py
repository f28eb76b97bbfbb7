"""rota_etcd's hook implementations, registered through the ``rota`` entry point."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.hookspecs import hookimpl

if TYPE_CHECKING:  # loaded by the hooks, when an orchestrator is made: rota --help starts without aetcd
    from rota.orchestrator import OrchestratorConfig
    from rota_etcd._replica import Replica
    from rota_etcd._store import EtcdStore


@hookimpl
def rota_orchestrator(config: OrchestratorConfig, url: str, listen: str) -> Replica | None:
    """Serve ``--etcd URL`` as an HA replica that elects a leader through etcd (none without ``url``)."""
    from rota_etcd._replica import Replica
    from rota_etcd._store import EtcdStore

    return Replica(EtcdStore(url), config, listen=listen) if url else None


@hookimpl
def rota_store(url: str) -> EtcdStore | None:
    """Serve ``--etcd http://HOST:PORT[,...]`` (and bare ``HOST:PORT`` lists)."""
    from rota_etcd._store import EtcdStore

    return EtcdStore(url)
