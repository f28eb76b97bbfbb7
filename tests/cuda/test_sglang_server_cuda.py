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

from pathlib import Path
from typing import Any

import pytest

from tests.cuda.served import ENGINE_SHARE, check_turns, take_turns

pytestmark = pytest.mark.engines  # the tier's engines part (ROTA_TIER_PART=engines bash bench/cuda_tier.sh)

pytest.importorskip("sglang", reason="sglang is not importable here: stage sglang 0.5.17 on the GPU machine with "
                                     "bench/stage_wheels.py (bench/engines/sglang-0.5.17.toml), then run the tier")


@pytest.mark.timeout(900)  # the server's start-up (a capture with CUDA graphs) and two park/restore cycles
@pytest.mark.parametrize(("backup", "graphs"), [("sglang", False), ("sglang", True), ("none", False)],
                         ids=["weights-kept", "weights-kept-cuda-graphs", "weights-dropped"])
def test_rota_sglang_serve_parks_for_another_job_and_answers_the_same(tmp_path: Path, qwen3_snapshot: Path,
                                                                      backup: str, graphs: bool, record: Any) -> None:
    from rota_sglang import SglangServer

    def push(url: str) -> None:  # what an RL loop does after a restore that dropped the weights
        server = SglangServer(url)
        server.update_weights_from_disk(str(qwen3_snapshot))
        server.flush_cache()

    model = str(qwen3_snapshot)
    group = f"sglang-serve-{backup}-{'graphs' if graphs else 'eager'}"
    engine_args = ["--model-path", model, "--dtype", "bfloat16", "--mem-fraction-static", str(ENGINE_SHARE),
                   "--context-length", "1024", "--random-seed", "0", "--attention-backend", "triton",
                   "--disable-radix-cache"]
    if not graphs:
        engine_args.append("--disable-cuda-graph")
    seen = take_turns("sglang", backup, engine_args, model, group, tmp_path, push=push if backup == "none" else None)
    check_turns(seen, record, backup=backup, cuda_graphs=graphs)
