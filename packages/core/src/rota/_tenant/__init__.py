"""The tenant process's side of rota: what runs inside a trainer or server that takes turns.

``client`` is ``rota.Gpu`` and ``rota.connect`` (turns, parks and restores); ``session`` its
Attach stream (heartbeats, and the commands the orchestrator sends); ``link`` its channel to the
orchestrator (following the leader), which the session and the lease hooks share; ``lease`` the
built-in ``rota_acquire``/``rota_release`` plugin over gRPC, given the request and the link;
``collectives`` the built-in ``rota_job_aborted`` plugin; ``local`` finds or starts this user's
embedded orchestrator (its own process, on a Unix socket). Nothing here imports the orchestrator's side
(``rota._orchestrator``): the two meet only on the wire. Private: the public names are
``rota``'s.
"""
