"""The orchestrator process's side of rota: what grants turns.

``turns`` is the orchestrator (acquires, releases, evictions and the watchdog, over group
state in a store), with its parts beside it: ``sessions`` (tenant sessions), ``driver``
(switches, prefetch), ``agents`` (node-agent links), ``config``, ``store``; ``state`` is one
group's state and its transitions; ``lanes`` a group over several devices; ``service`` and
``grpc_server`` the gRPC API it serves; ``metrics`` its Prometheus collectors; ``inproc`` runs
one in the caller's process (tests, the Tinker service). Private: the public names are
``rota.orchestrator``'s (and ``rota.rpc``'s, ``rota.types``'). Nothing here is imported by
the tenant's side (``rota._tenant``): the two meet only on the wire.
"""
