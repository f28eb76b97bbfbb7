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

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cuda.served import CYCLES, ENGINE_SHARE, FILL, GB, MIB, PARKED_MAX, tail, take_turns

pytest.importorskip("vllm", reason="vllm is not importable here: stage vllm 0.26.0 on the GPU machine with "
                                   "bench/stage_wheels.py (see the README), then run the tier")


@pytest.mark.timeout(900)  # the server's start-up (a compile with CUDA graphs) and two park/restore cycles
@pytest.mark.parametrize(("backup", "graphs"), [("rota", False), ("rota", True), ("vllm", False)],
                         ids=["rota-eager", "rota-cuda-graphs", "vllm-eager"])
def test_rota_vllm_serve_parks_for_another_job_and_answers_the_same(tmp_path: Path, qwen3_snapshot: Path,
                                                                    backup: str, graphs: bool, record: Any) -> None:
    from rota.rpc import free_port
    from rota.testing import running_orchestrator

    os.chmod(tmp_path, 0o700)
    listen = f"127.0.0.1:{free_port()}"
    url, model = f"http://{listen}", str(qwen3_snapshot)
    group = f"serve-{backup}-{'graphs' if graphs else 'eager'}"
    engine_args = ["--model", model, "--dtype", "bfloat16", "--gpu-memory-utilization", str(ENGINE_SHARE),
                   "--max-model-len", "1024", "--seed", "0", "--no-enable-prefix-caching"]
    if not graphs:
        engine_args.append("--enforce-eager")
    log_path = tmp_path / "serve.log"
    with running_orchestrator() as (endpoint, _):
        command = [sys.executable, "-m", "rota", "vllm", "serve", "--listen", listen, "--group", group, "--tenant",
                   "engine", "--orchestrator", endpoint, "--idle-release", "0.2", "--backup", backup, "--",
                   *engine_args]
        seen = take_turns(command, url, model, endpoint, group, log_path, cycles=CYCLES, fill_share=FILL,
                          env={"VLLM_USE_FLASHINFER_SAMPLER": "0"})
    end = tail(log_path, 3000)
    parked, awake, total = seen["parked"], seen["awake"], seen["total"]
    record(backup=backup, cuda_graphs=graphs, start_s=seen["start_s"], awake_mib=awake // MIB,
           parked_mib=[b // MIB for b in parked], trainer_filled=seen["filled"], tokens_equal=seen["same"],
           request_waited=seen["waited"])
    assert all(seen["waited"]), f"a request did not wait for the engine's turn: {seen['waited']}\n{end}"
    assert awake > ENGINE_SHARE * total * 0.8, f"the awake engine holds {awake / GB:.1f} GiB: not the engine's?"
    assert max(parked) <= PARKED_MAX, f"NVML of the parked engine: {[b // MIB for b in parked]} MiB\n{end}"
    assert all(seen["filled"]), f"the trainer could not fill {FILL:.0%} of the device beside the parked engine"
    assert all(seen["same"]), f"greedy completions after a restore differ from before the first park\n{end}"
