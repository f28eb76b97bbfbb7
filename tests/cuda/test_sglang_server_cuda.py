"""``rota sglang serve`` on a real GPU (issue 41, item 5): SGLang's own server behind rota's proxy, parked when a
trainer of another job asks for the device and resumed by the next request.

The server loads a Qwen3-0.6B-shaped snapshot built here (random bf16 weights and a small local tokenizer,
``save_pretrained``), with ``--attention-backend triton`` (the staged sglang-kernel has FlashAttention 3 pruned).
This process is the other job: it acquires the group, which parks the engine, and fills 60% of the device in
its turn, which fits only if the park freed the engine's 50%. Checked, with ``--backup sglang`` (the weights
kept in host memory; eager, and with CUDA graphs captured, which the park releases too) and ``--backup none``
(dropped; pushed again with ``update_weights_from_disk`` after each restore, as an RL loop does):

* while parked, NVML of the engine's processes is at most ``PARKED_MAX`` (their CUDA contexts and residue);
* greedy completions after every restore equal those before the first park;
* with the weights kept, a request sent while the trainer holds the device waits for the engine's turn.

Needs SGLang (0.5.17: bench/stage_wheels.py with bench/engines/sglang-0.5.17.toml) importable; skipped
otherwise, saying so.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cuda.served import CYCLES, ENGINE_SHARE, FILL, GB, MIB, PARKED_MAX, tail, take_turns

pytest.importorskip("sglang", reason="sglang is not importable here: stage sglang 0.5.17 on the GPU machine with "
                                     "bench/stage_wheels.py (bench/engines/sglang-0.5.17.toml), then run the tier")


@pytest.mark.timeout(900)  # the server's start-up (a capture with CUDA graphs) and two park/restore cycles
@pytest.mark.parametrize(("backup", "graphs"), [("sglang", False), ("sglang", True), ("none", False)],
                         ids=["weights-kept", "weights-kept-cuda-graphs", "weights-dropped"])
def test_rota_sglang_serve_parks_for_another_job_and_answers_the_same(tmp_path: Path, qwen3_snapshot: Path,
                                                                      backup: str, graphs: bool, record: Any) -> None:
    from rota.rpc import free_port
    from rota.testing import running_orchestrator
    from rota_sglang import SglangServer

    def push(url: str) -> None:  # what an RL loop does after a restore that dropped the weights
        server = SglangServer(url)
        server.update_weights_from_disk(str(qwen3_snapshot))
        server.flush_cache()

    os.chmod(tmp_path, 0o700)
    listen = f"127.0.0.1:{free_port()}"
    url, model = f"http://{listen}", str(qwen3_snapshot)
    group = f"sglang-serve-{backup}-{'graphs' if graphs else 'eager'}"
    engine_args = ["--model-path", model, "--dtype", "bfloat16", "--mem-fraction-static", str(ENGINE_SHARE),
                   "--context-length", "1024", "--random-seed", "0", "--attention-backend", "triton",
                   "--disable-radix-cache"]
    if not graphs:
        engine_args.append("--disable-cuda-graph")
    log_path = tmp_path / "serve.log"
    with running_orchestrator() as (endpoint, _):
        command = [sys.executable, "-m", "rota", "sglang", "serve", "--listen", listen, "--group", group, "--tenant",
                   "engine", "--orchestrator", endpoint, "--idle-release", "0.2", "--backup", backup, "--",
                   *engine_args]
        seen = take_turns(command, url, model, endpoint, group, log_path, cycles=CYCLES, fill_share=FILL,
                          push=push if backup == "none" else None)
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
