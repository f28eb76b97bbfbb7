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

from pathlib import Path
from typing import Any

import pytest

from tests.cuda.served import ENGINE_SHARE, check_turns, take_turns

pytestmark = pytest.mark.engines  # the tier's engines part (ROTA_TIER_PART=engines bash bench/cuda_tier.sh)

pytest.importorskip("vllm", reason="vllm is not importable here: stage vllm 0.26.0 on the GPU machine with "
                                   "bench/stage_wheels.py (see the README), then run the tier")


@pytest.mark.timeout(900)  # the server's start-up (a compile with CUDA graphs) and two park/restore cycles
@pytest.mark.parametrize(("backup", "graphs"), [("rota", False), ("rota", True), ("vllm", False)],
                         ids=["rota-eager", "rota-cuda-graphs", "vllm-eager"])
def test_rota_vllm_serve_parks_for_another_job_and_answers_the_same(tmp_path: Path, qwen3_snapshot: Path,
                                                                    backup: str, graphs: bool, record: Any) -> None:
    model = str(qwen3_snapshot)
    group = f"serve-{backup}-{'graphs' if graphs else 'eager'}"
    engine_args = ["--model", model, "--dtype", "bfloat16", "--gpu-memory-utilization", str(ENGINE_SHARE),
                   "--max-model-len", "1024", "--seed", "0", "--no-enable-prefix-caching"]
    if not graphs:
        engine_args.append("--enforce-eager")
    seen = take_turns("vllm", backup, engine_args, model, group, tmp_path, env={"VLLM_USE_FLASHINFER_SAMPLER": "0"})
    check_turns(seen, record, backup=backup, cuda_graphs=graphs)
