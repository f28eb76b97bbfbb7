"""What an operator reads: a bad flag names the flag, refused credentials and evictions are warnings.

Real parts: `rota orchestrator serve` processes for the flags; an orchestrator over real gRPC on loopback that
checks tokens, a real client without one, a real eviction through rota.admin.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import rota
from rota import admin, auth
from rota.errors import Unauthenticated
from rota.testing import running_orchestrator


@pytest.mark.parametrize("flag,value,says", [
    ("--ttl", "-5", "Invalid value for '--ttl': -5.0 is not in the range x>0"),
    ("--ttl", "nan", "Invalid value for '--ttl': 'nan' is not a finite number of seconds"),
    ("--park-timeout", "0", "Invalid value for '--park-timeout'"),
    ("--max-turn", "inf", "Invalid value for '--max-turn': 'inf' is not a finite number"),
    ("--idle-exit", "-1", "Invalid value for '--idle-exit'"),
    ("--v1-max-turn", "-1", "Invalid value for '--v1-max-turn'"),
])
def test_a_bad_time_flag_is_named_as_the_flag(flag, value, says, tmp_path):
    out = subprocess.run([sys.executable, "-m", "rota", "orchestrator", "serve", "--listen",
                          f"unix:{tmp_path}/o.sock", flag, value], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and says in out.stderr and "_s=" not in out.stderr, out.stderr


def test_refused_credentials_and_evictions_are_logged_as_warnings(caplog):
    key = b"k" * 32
    with running_orchestrator(auth=auth.ServerAuth(key=key)) as (endpoint, _):
        intruder = rota.Gpu("g", "t", endpoint, connect_timeout_s=30)
        with caplog.at_level(logging.WARNING), pytest.raises(Unauthenticated):
            intruder.acquire()
        intruder.close()
        refused = [r for r in caplog.records if r.getMessage().startswith("refused ")]
        assert refused and refused[0].levelno == logging.WARNING
        assert "127.0.0.1" in refused[0].getMessage() and "no bearer token" in refused[0].getMessage()

        token = auth.issue(key, group="g", job="holder")
        holder = rota.Gpu("g", "holder", endpoint, token=token)
        holder.acquire()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rota._orchestrator"):
            result = admin.evict(endpoint, "holder", "g", reason="node drained", token=auth.issue(key, admin=True))
        assert result.was_holder
        evicted = [r for r in caplog.records if r.getMessage().startswith("evicted job holder")]
        assert evicted and evicted[0].levelno == logging.WARNING and "node drained" in evicted[0].getMessage()
        holder.close()
