"""`rota slurm status` and `rota slurm epilog` against an orchestrator that is down or silent: one line naming
the address and the setting, within the timeout (--timeout, ROTA_CONNECT_TIMEOUT_S).

Real parts: the installed `rota` executable in its own process, a real TCP listener that accepts and never
answers (rota.testing.silent_listener), a port nobody listens on. No Slurm daemon is needed: the orchestrator
is asked first. And every option of `rota slurm` has help text.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import click

from rota.testing import free_port, silent_listener

ROTA = str(Path(sys.executable).parent / "rota")


def _run(*args: str, env: dict[str, str] | None = None) -> tuple[str, int, float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    t0 = time.monotonic()
    out = subprocess.run([ROTA, *args], capture_output=True, text=True, timeout=120, env={**base, **(env or {})})
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0], out.returncode, time.monotonic() - t0


def test_slurm_status_with_a_silent_orchestrator():
    with silent_listener() as address:
        line, rc, took = _run("slurm", "status", "--orchestrator", address, env={"ROTA_CONNECT_TIMEOUT_S": "1.5"})
        assert rc == 1 and f"the orchestrator at {address} did not answer within 1.5 s" in line
        assert "ROTA_CONNECT_TIMEOUT_S" in line and 1.4 < took < 30
        line, rc, took = _run("slurm", "status", "--orchestrator", address, "--timeout", "1")
        assert rc == 1 and "within 1 s" in line and "--timeout" in line and took < 30


def test_slurm_status_with_a_refused_orchestrator():
    address = f"127.0.0.1:{free_port()}"
    line, rc, _ = _run("slurm", "status", "--orchestrator", address)
    assert rc == 1 and line.startswith(f"Error: cannot reach the orchestrator at {address} (")


def test_slurm_epilog_with_a_silent_orchestrator_gives_up_at_its_timeout():
    with silent_listener() as address:
        line, rc, took = _run("slurm", "epilog", "--job", "7", "--group", "g", "--orchestrator", address,
                              "--timeout", "1.5")
    assert rc == 1 and address in line and "within 1.5 s" in line and took < 30


def test_every_slurm_option_has_help():
    """`rota slurm check --backend` (and every other option of rota slurm) says what it does in --help."""
    from rota.testing import cli_with_plugins

    slurm = cli_with_plugins().commands["slurm"]
    missing = [f"{name} {opt.opts[0]}" for name, cmd in slurm.commands.items() for opt in cmd.params
               if isinstance(opt, click.Option) and not opt.hidden and not opt.help]
    assert missing == []
    out = subprocess.run([ROTA, "slurm", "check", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "How to read Slurm's jobs: cli (squeue/scontrol), pyslurm" in " ".join(out.split())
