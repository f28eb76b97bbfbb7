"""A served engine as the CUDA tier's server tests see it (``rota vllm serve``, ``rota sglang serve``): its
OpenAI completions, its readiness, its log, and the device memory of its processes."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.cuda.park_probe import device_processes, fill_fits

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
    return sum(n for pid, n in device_processes().items() if pid != os.getpid())


def stop(proc: subprocess.Popen) -> None:
    """Terminate a server, killing it if it has not exited within 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def take_turns(command: list[str], url: str, model: str, endpoint: str, group: str, log_path: Path, *,
               cycles: int, fill_share: float, push: Any = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start ``command`` (a ``rota … serve`` serving ``url`` in ``group``), and as this process, the trainer of
    another job, take ``cycles`` turns from it: each parks the engine, reads NVML of its processes, fills
    ``fill_share`` of the device and gives the turn back. Then the engine answers again: with ``push`` (called
    with ``url`` after the turn) once the weights are pushed; without, a request sent during the trainer's
    turn, which must wait for it. ``env``: the server's, besides this process's. What each cycle saw, for the
    test's asserts and its record."""
    import torch

    import rota

    log = log_path.open("w")
    env = os.environ | (env or {}) | {"PYTHONUNBUFFERED": "1", "XDG_RUNTIME_DIR": str(log_path.parent),
                                      "ROTA_RESIDUE_MAX_BYTES": "0"}  # NVML of the engine's processes is read here
    t0 = time.monotonic()
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    trainer = rota.connect(group=group, tenant="trainer", endpoint=endpoint)
    seen: dict[str, Any] = {"parked": [], "filled": [], "same": [], "waited": []}
    try:
        wait_ready(url, proc, 600, log_path, " ".join(command[2:5]))
        seen["start_s"] = time.monotonic() - t0
        before = complete(url, model)
        seen["awake"] = engine_bytes()
        seen["total"] = torch.cuda.get_device_properties(0).total_memory
        for _ in range(cycles):
            time.sleep(0.5)  # past --idle-release: the engine has given its turn back
            trainer.acquire()  # the engine parks
            seen["parked"].append(engine_bytes())
            seen["filled"].append(fill_fits(int(seen["total"] * fill_share)))
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
    finally:
        trainer.close()
        stop(proc)
        log.close()
        keep = os.environ.get("STEP_OUT") or os.environ.get("OUT")  # the device tool's folders, where set
        if keep:
            Path(keep, f"{group}.log").write_text(log_path.read_text(errors="replace"))
    return seen
