"""rota_etcd: the rota orchestrator with its state in etcd, run as HA replicas.

Install it beside rota-core and serve::

    pip install rota-orchestrator-etcd
    rota orchestrator serve --etcd http://etcd-0:2379,http://etcd-1:2379 --listen 0.0.0.0:50051

Run two or more replicas against the same etcd. One is elected leader through etcd
and grants turns; the others answer UNAVAILABLE naming the leader (rota clients
follow it; list every replica in ``ROTA_ORCHESTRATOR=a:50051,b:50051``). Groups,
holders, queues, fencing tokens, per-tenant GPU time and loaded jobs live in etcd, so
a leader change or a restart of every replica loses no queue position and no holder.
Every commit is an etcd transaction conditioned on the leader's term, so a deposed
leader cannot grant. ``rota status --etcd URL`` reads the same state. The package
README documents the key layout.

:class:`EtcdStore` is what the ``rota_store`` hook returns for ``--etcd``;
:mod:`rota_etcd.testing` starts real etcd members for tests.
"""

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time each loads on first use, so
    # that loading the plugin (rota --help) imports none of them
    from rota_etcd._replica import Replica
    from rota_etcd._store import EtcdStore

__all__ = ["EtcdStore", "Replica"]


_HOME = {
    "Replica": "rota_etcd._replica",
    "EtcdStore": "rota_etcd._store",
}
__getattr__ = lazy_getattr(__name__, _HOME)
