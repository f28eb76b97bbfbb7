"""A client built only from the v1alpha1 protos (compiled here, no rota code) works
against the embedded orchestrator: Acquire, Yield, ListGroups, GetGroupStatus."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from grpc_tools import protoc

HERE = pathlib.Path(__file__).resolve().parent
PROTO = HERE.parent / "proto/rota/_generated/timeslice_orchestrator.proto"


def test_plain_wire_client_round_trip(orchestrator, tmp_path):
    endpoint, _ = orchestrator
    (tmp_path / "timeslice_orchestrator.proto").write_text(PROTO.read_text())
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    assert protoc.main(["protoc", f"-I{tmp_path}", f"-I{include}", f"--python_out={tmp_path}",
                        f"--grpc_python_out={tmp_path}", str(tmp_path / "timeslice_orchestrator.proto")]) == 0
    r = subprocess.run([sys.executable, str(HERE / "wire_client_script.py"), endpoint], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})  # the stubs only
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr
