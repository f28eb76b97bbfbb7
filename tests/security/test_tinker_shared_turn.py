"""A shared LoRA turn's gate (rota_tinker._worker.shared_turn) admits only the service's own trainer processes.

The gate decides who runs on the device inside the shared rota turn. It listens on the base
holder's Unix socket, and a connection must answer multiprocessing's HMAC challenge with the
service's authkey, which only the processes the service spawned hold. A local process without
it, even of the same uid, cannot take a place in the shared turn nor make its tenant take a turn.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import threading

import pytest

import rota
from rota.testing import running_orchestrator
from rota_tinker._worker.shared_turn import SharedTurnGate


def test_a_process_without_the_services_key_cannot_enter_the_shared_turn() -> None:
    secret = os.urandom(32)  # the service's children inherit its authkey; an outsider does not have it
    with running_orchestrator() as (endpoint, _engine):
        tenant = rota.connect(group="shared-auth", tenant="lora-shared.0", endpoint=endpoint)
        gate = SharedTurnGate(tenant, limit=1)
        listener = mpc.Listener(family="AF_UNIX", authkey=secret)
        refused: list[BaseException] = []

        def serve() -> None:
            while True:
                try:
                    conn = listener.accept()
                except mpc.AuthenticationError as e:
                    refused.append(e)
                    continue
                except OSError:
                    return
                if conn.recv() == ("gate",):
                    threading.Thread(target=gate.serve, args=(conn,), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()
        try:
            with pytest.raises(mpc.AuthenticationError):
                mpc.Client(listener.address, family="AF_UNIX", authkey=os.urandom(32))
            for _ in range(500):  # a hang guard: the server side notices at once
                if refused:
                    break
                threading.Event().wait(0.01)
            assert refused and gate.running == 0 and tenant.grant is None  # no place taken, no turn taken

            trainer = mpc.Client(listener.address, family="AF_UNIX", authkey=secret)  # the service's own
            trainer.send(("gate",))
            trainer.send(("enter",))
            assert trainer.recv()[0] == "ok" and gate.running == 1
            trainer.send(("leave", 0, 0))
            trainer.close()
        finally:
            listener.close()
            gate.close()
            tenant.close()
