"""The SGLang engine's process for tests/cuda/test_sglang_cuda.py, run as a script:
``python tests/cuda/sglang_engine.py SNAPSHOT BACKUP OUT``.

A file of its own because ``sglang.Engine`` starts its scheduler with multiprocessing's spawn, which imports the
main script again in the child: this one imports nothing at module level that the child cannot, and runs
nothing unless it is ``__main__``. Generates in each of its turns and waits for the other job's turn between.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TURNS = 3
ENGINE_SHARE = 0.5  # mem_fraction_static
PROMPTS = ["the quick brown fox", "a model of the world", "rota takes turns", "one two three four"]


def engine(snapshot: str, backup: str, out: str) -> None:
    """The engine's process: generate in each turn; after a turn, wait for the other job's turn."""
    import sglang as sgl
    import torch
    from park_probe import wait_for_count, write_count
    from safetensors.torch import load_file

    import rota
    import rota_sglang

    eng = sgl.Engine(model_path=snapshot, random_seed=0, enable_memory_saver=True, dtype="bfloat16",
                     enable_weights_cpu_backup=backup == "cpu", mem_fraction_static=ENGINE_SHARE,
                     attention_backend="triton", disable_cuda_graph=True, disable_radix_cache=True,
                     log_level="warning")
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(Path(snapshot).glob("*.safetensors")):
        weights |= load_file(str(f))
    gpu = rota.connect()
    tracked = rota_sglang.track(gpu, eng)
    texts, stale = [], []
    for turn in range(TURNS):
        with gpu.turn():
            stale.append(tracked.weights_stale)
            if tracked.weights_stale:  # dropped at the park: the snapshot's weights again
                tracked.update_weights([(k, v.to("cuda")) for k, v in weights.items()])
            texts.append([o["text"] for o in eng.generate(PROMPTS, params)])
        write_count(Path(out).with_suffix(".engine"), turn + 1)
        if turn + 1 < TURNS:  # the other job's turn (this engine parked)
            wait_for_count(Path(out).with_suffix(".other"), turn + 1, "the other job", 600)
    Path(out).write_text(json.dumps({"texts": texts, "stale_at_turn": stale, "parks": len(gpu.stats.parks),
                                     "restores": len(gpu.stats.restores),
                                     "failures": [str(f) for f in gpu.stats.failures],
                                     "park_s": [p.seconds for p in gpu.stats.parks],
                                     "restore_s": [r.seconds for r in gpu.stats.restores],
                                     "dropped": list(tracked.dropped)}))
    tracked.untrack()
    eng.shutdown()
    gpu.close()


if __name__ == "__main__":
    engine(*sys.argv[1:4])
    sys.exit(0)
