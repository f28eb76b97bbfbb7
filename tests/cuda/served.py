"""A served engine as the CUDA tier's server tests see it (``rota vllm serve``, ``rota sglang serve``): its
OpenAI completions, its readiness, its log, and the device memory of its processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.cuda.park_probe import bare_context_mib, fill_fits, others_bytes

PROMPTS = ["the quick brown fox", "a model of the world", "rota takes turns", "one two three four"]
GB = 1 << 30
MIB = 1 << 20
ENGINE_SHARE = 0.5  # of the device, the served engine's (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static)
FILL = 0.6  # of the device, filled by the trainer in its turn: fits only beside a parked engine
PARKED_MAX = 2 * GB  # NVML bytes of all the engine's processes while parked (contexts, cuBLAS, residue)
CYCLES = 2  # the trainer's turns, each parking the engine once


def post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url``; the JSON answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def complete(url: str, model: str) -> list[str]:
    """Greedy completions of every prompt (``ignore_eos``: random weights may end early otherwise)."""
    got = post(url + "/v1/completions", {"model": model, "prompt": PROMPTS, "max_tokens": 16, "temperature": 0,
                                         "ignore_eos": True})
    return [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])]


def tail(log: Path, n: int = 6000) -> str:
    """The end of a server's log."""
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, log: Path, what: str) -> None:
    """Until ``url`` lists its models; raises with the log's end when ``proc`` (``what``) exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited {proc.returncode} before it served; its log ends:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise AssertionError(f"{what} did not serve {url} within {timeout:.0f} s; its log ends:\n{tail(log)}")


def engine_bytes() -> int:
    """NVML bytes of every process on device 0 but this one (the served engine's)."""
    return sum(others_bytes(os.getpid()))


def stop(proc: subprocess.Popen) -> None:
    """Terminate a server, killing it if it has not exited within 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def take_turns(app: str, backup: str, engine_args: list[str], model: str, group: str, tmp_path: Path, *,
               push: Any = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Serve ``model`` with ``rota APP serve --backup BACKUP -- ENGINE_ARGS`` in ``group`` of an orchestrator
    started here, and as this process, the trainer of another job, take ``CYCLES`` turns from it: each parks the
    engine, reads NVML of its processes, fills ``FILL`` of the device and gives the turn back. Then the engine
    answers again: with ``push`` (called with the served URL after the turn) once the weights are pushed;
    without, a request sent during the trainer's turn, which must wait for it. ``env``: the server's, besides
    this process's. What each cycle saw (and the server's ``log``), for :func:`check_turns`."""
    import torch

    import rota
    from rota.rpc import free_port
    from rota.testing import running_orchestrator

    os.chmod(tmp_path, 0o700)
    listen = f"127.0.0.1:{free_port()}"
    url, log_path = f"http://{listen}", tmp_path / "serve.log"
    env = os.environ | (env or {}) | {"PYTHONUNBUFFERED": "1", "XDG_RUNTIME_DIR": str(tmp_path),
                                      "ROTA_RESIDUE_MAX_BYTES": "0"}  # NVML of the engine's processes is read here
    seen: dict[str, Any] = {"parked": [], "filled": [], "same": [], "waited": [], "log": log_path}
    with running_orchestrator() as (endpoint, _), log_path.open("w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "rota", app, "serve", "--listen", listen, "--group", group,
                                 "--tenant", "engine", "--orchestrator", endpoint, "--idle-release", "0.2",
                                 "--backup", backup, "--", *engine_args], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        trainer = rota.connect(group=group, tenant="trainer", endpoint=endpoint)
        try:
            wait_ready(url, proc, 600, log_path, f"rota {app} serve")
            seen["start_s"] = time.monotonic() - t0
            before = complete(url, model)
            seen["awake"] = engine_bytes()
            seen["total"] = torch.cuda.get_device_properties(0).total_memory
            for _ in range(CYCLES):
                time.sleep(0.5)  # past --idle-release: the engine has given its turn back
                trainer.acquire()  # the engine parks
                seen["parked"].append(others_bytes(os.getpid()))  # per process: one NVML reading per park
                seen["filled"].append(fill_fits(int(seen["total"] * FILL)))
                torch.cuda.empty_cache()
                if push is not None:  # weights dropped: push them again (in the engine's turn), then ask
                    trainer.release()
                    push(url)
                    seen["same"].append(complete(url, model) == before)
                    continue
                got: dict[str, list[str]] = {}
                asker = threading.Thread(target=lambda got=got: got.update(texts=complete(url, model)))
                asker.start()
                asker.join(1.0)
                seen["waited"].append(asker.is_alive())  # the request waits for the engine's turn
                trainer.release()
                asker.join(300)
                seen["same"].append(got.get("texts") == before)
        finally:  # the server's log is kept where the device tool brings it back (STEP_OUT, OUT), failed or not
            trainer.close()
            stop(proc)
            if keep := os.environ.get("STEP_OUT") or os.environ.get("OUT"):
                Path(keep, f"{group}.log").write_text(log_path.read_text(errors="replace"))
    return seen


def check_turns(seen: dict[str, Any], record: Any, **figures: Any) -> None:
    """Record what :func:`take_turns` saw (with ``figures``) in the tier's JSON, and check it: every request
    sent in the trainer's turn waited for it, the awake engine held its share, the parked engine's processes
    held at most ``PARKED_MAX``, the trainer's fill fitted beside them, and greedy completions after every
    restore equal those before the first park."""
    end = tail(seen["log"], 3000)
    parked, awake, total = [sum(each) for each in seen["parked"]], seen["awake"], seen["total"]
    record(**figures, start_s=seen["start_s"], awake_mib=awake // MIB, parked_mib=[b // MIB for b in parked],
           parked_by_process_mib=[[b // MIB for b in each] for each in seen["parked"]],
           bare_context_mib=bare_context_mib(),
           trainer_filled=seen["filled"], tokens_equal=seen["same"], request_waited=seen["waited"])
    assert all(seen["waited"]), f"a request did not wait for the engine's turn: {seen['waited']}\n{end}"
    assert awake > ENGINE_SHARE * total * 0.8, f"the awake engine holds {awake / GB:.1f} GiB: not the engine's?"
    assert max(parked) <= PARKED_MAX, f"NVML of the parked engine: {[b // MIB for b in parked]} MiB\n{end}"
    assert all(seen["filled"]), f"the trainer could not fill {FILL:.0%} of the device beside the parked engine"
    assert all(seen["same"]), f"greedy completions after a restore differ from before the first park\n{end}"
