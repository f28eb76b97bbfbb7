"""``rota vllm serve`` on a real GPU (issue 41): the command users run, vLLM 0.26's OpenAI server behind rota's
proxy, parked when a trainer of another job asks for the device and woken by the next request.

The server loads a Qwen3-0.6B-shaped snapshot built here (random bf16 weights and a small local tokenizer,
``save_pretrained``). This process is the other job: it acquires the group, which parks the engine, and fills
60% of the device in its turn, which fits only if the park freed the engine's 50%. Checked, with
``--backup rota`` (eager, and with CUDA graphs captured) and ``--backup vllm``:

* while parked, NVML of the engine's processes is at most ``PARKED_MAX`` (their CUDA contexts and residue);
* greedy completions after every restore equal those before the first park;
* a request sent while the trainer holds the device waits for the engine's turn and then completes.

Needs vLLM (0.26.0 on the H200 host: bench/stage_wheels.py) importable; skipped otherwise, saying so.
"""

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

import pytest

from tests.cuda.park_probe import device_processes, fill_fits

pytest.importorskip("vllm", reason="vllm is not importable here: stage vllm 0.26.0 on the GPU machine with "
                                   "bench/stage_wheels.py (see the README), then run the tier")

GB = 1 << 30
MIB = 1 << 20
ENGINE_SHARE = 0.5  # --gpu-memory-utilization
FILL = 0.6  # of the device, filled by the trainer in its turn: fits only beside a parked engine
PARKED_MAX = 2 * GB  # NVML bytes of all the engine's processes while parked (contexts, cuBLAS, residue)
CYCLES = 2
PROMPTS = ["the quick brown fox", "a model of the world", "rota takes turns", "one two three four"]


def _post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _complete(url: str, model: str) -> list[str]:
    """Greedy completions of every prompt (``ignore_eos``: random weights may end early otherwise)."""
    got = _post(url + "/v1/completions", {"model": model, "prompt": PROMPTS, "max_tokens": 16, "temperature": 0,
                                          "ignore_eos": True})
    return [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])]


def _tail(log: Path, n: int = 6000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"rota vllm serve exited {proc.returncode} before it served; its log ends:\n"
                                 f"{_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise AssertionError(f"rota vllm serve did not serve {url} within {timeout:.0f} s; its log ends:\n{_tail(log)}")


def _engine_bytes() -> int:
    """NVML bytes of every process on device 0 but this one (the served engine's)."""
    return sum(n for pid, n in device_processes().items() if pid != os.getpid())


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rota_tinker.testing import QWEN3_SHAPES, hf_snapshot

    shape = {k: v for k, v in QWEN3_SHAPES["qwen3-0.6b"].items() if k not in ("vocab_size", "tie")}
    return hf_snapshot(tmp_path_factory.mktemp("qwen3-0.6b-served"), "qwen3", tie=True, dtype="bfloat16",
                       max_position_embeddings=2048, **shape)  # the local tokenizer's vocabulary


@pytest.mark.timeout(900)  # the server's start-up (a compile with CUDA graphs) and two park/restore cycles
@pytest.mark.parametrize(("backup", "graphs"), [("rota", False), ("rota", True), ("vllm", False)],
                         ids=["rota-eager", "rota-cuda-graphs", "vllm-eager"])
def test_rota_vllm_serve_parks_for_another_job_and_answers_the_same(tmp_path: Path, snapshot: Path, backup: str,
                                                                    graphs: bool, record: Any) -> None:
    import torch

    import rota
    from rota.rpc import free_port
    from rota.testing import running_orchestrator

    os.chmod(tmp_path, 0o700)
    listen = f"127.0.0.1:{free_port()}"
    url, model = f"http://{listen}", str(snapshot)
    group = f"serve-{backup}-{'graphs' if graphs else 'eager'}"
    env = os.environ | {"VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1", "XDG_RUNTIME_DIR": str(tmp_path),
                        "ROTA_RESIDUE_MAX_BYTES": "0"}  # NVML of the engine's processes is read here instead
    engine_args = ["--model", model, "--dtype", "bfloat16", "--gpu-memory-utilization", str(ENGINE_SHARE),
                   "--max-model-len", "1024", "--seed", "0", "--no-enable-prefix-caching"]
    if not graphs:
        engine_args.append("--enforce-eager")
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    with running_orchestrator() as (endpoint, _):
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "rota", "vllm", "serve", "--listen", listen, "--group", group,
                                 "--tenant", "engine", "--orchestrator", endpoint, "--idle-release", "0.2",
                                 "--backup", backup, "--", *engine_args], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        trainer = rota.connect(group=group, tenant="trainer", endpoint=endpoint)
        try:
            _wait_ready(url, proc, 600, log_path)
            start_s = time.monotonic() - t0
            before = _complete(url, model)
            awake = _engine_bytes()
            total = torch.cuda.get_device_properties(0).total_memory
            parked, filled, same, waited = [], [], [], []
            for _ in range(CYCLES):
                time.sleep(0.5)  # past --idle-release: the engine has given its turn back
                trainer.acquire()  # the engine parks
                parked.append(_engine_bytes())
                filled.append(fill_fits(int(total * FILL)))
                torch.cuda.empty_cache()
                got: dict[str, list[str]] = {}
                asker = threading.Thread(target=lambda got=got: got.update(texts=_complete(url, model)))
                asker.start()
                asker.join(1.0)
                waited.append(asker.is_alive())  # the request waits for the engine's turn
                trainer.release()
                asker.join(300)
                same.append(got.get("texts") == before)
        finally:
            trainer.close()
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
            keep = os.environ.get("STEP_OUT") or os.environ.get("OUT")  # the device tool's folders, where set
            if keep:
                Path(keep, f"vllm-serve-{group}.log").write_text(log_path.read_text(errors="replace"))
    tail = _tail(log_path, 3000)
    record(backup=backup, cuda_graphs=graphs, start_s=start_s, awake_mib=awake // MIB,
           parked_mib=[b // MIB for b in parked], trainer_filled=filled, tokens_equal=same, request_waited=waited)
    assert all(waited), f"a request did not wait for the engine's turn: {waited}\n{tail}"
    assert awake > ENGINE_SHARE * total * 0.8, f"the awake engine holds {awake / GB:.1f} GiB: not the engine's?"
    assert max(parked) <= PARKED_MAX, f"NVML of the parked engine: {[b // MIB for b in parked]} MiB\n{tail}"
    assert all(filled), f"the trainer could not fill {FILL:.0%} of the device beside the parked engine: {filled}"
    assert all(same), f"greedy completions after a restore differ from before the first park: {same}\n{tail}"
