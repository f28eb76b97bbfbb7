"""Where one batched LoRA step's time goes on a GPU (prints a log, not JSON: the engine's figures are
bench/multilora_step.py's).

On a Qwen3-shaped snapshot written with ``save_pretrained`` and loaded with ``from_pretrained``: the bare base's
forward+backward of 32 x 256 tokens (the ceiling of any LoRA pass over them), then the batched engine
(rota_tinker._worker.multilora) at N = 1, 4, 8 tenants of 8 x 256 tokens (step, forward_backward, optim_step),
then a torch.profiler table of one N = 4 step. bench/results/multilora-profile-h200-qwen3-1.7b.log is its run on
an H200 at 6105bb7 (before the grouped backward).

    python bench/multilora_profile.py --device cuda:0 --model qwen3-1.7b > bench/results/multilora-profile-h200.log
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch


def _timeit(fn: Callable[[], object], sync: Callable[[], None], k: int = 3) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    sync()
    return (time.perf_counter() - t0) / k


def main() -> None:
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from rota_tinker._worker.multilora import BatchedLora, Unit
    from rota_tinker.testing import QWEN3_SHAPES, qwen3_shaped

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(QWEN3_SHAPES))
    args = p.parse_args()
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    spec = qwen3_shaped(tempfile.mkdtemp(), args.model, "bfloat16", weights=True)
    model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.bfloat16, local_files_only=True).to(dev)
    rng = np.random.default_rng(0)

    def unit(tenant: str, rows: int = 8, length: int = 256) -> Unit:
        data = []
        for _ in range(rows):
            toks = rng.integers(0, spec.vocab, size=length + 1)
            data.append((toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(length, np.float32)}))
        return Unit(tenant, data)

    x = torch.as_tensor(rng.integers(0, spec.vocab, size=(32, 256)), device=dev)
    for param in model.parameters():
        param.requires_grad_(False)

    def base_step() -> None:
        emb = model.get_input_embeddings()(x).detach().requires_grad_(True)
        out = model(inputs_embeds=emb, attention_mask=torch.ones_like(x), use_cache=False)
        out.logits.float().log_softmax(-1).gather(2, x.unsqueeze(2)).sum().backward()

    print(f"base fwd+bwd 8192 tokens: {_timeit(base_step, sync):.4f} s", flush=True)
    engine = BatchedLora(model, dev)
    targets = {"attn": True, "mlp": True, "unembed": True}
    for n in (1, 4, 8):
        for i in range(len(engine.adapters), n):
            engine.add(f"t{i}", 16, seed=i, targets=targets)
        tenants = [f"t{i}" for i in range(n)]

        def fb(tenants: list[str] = tenants) -> None:
            engine.forward_backward([unit(t) for t in tenants])

        def opt(tenants: list[str] = tenants) -> None:
            for t in tenants:
                engine.optim_step(t, {"learning_rate": 1e-4})

        print(f"N={n}: step {_timeit(lambda: (fb(), opt()), sync):.4f} s, forward_backward {_timeit(fb, sync):.4f} s, "
              f"optim_step {_timeit(opt, sync):.4f} s", flush=True)
    tenants = [f"t{i}" for i in range(4)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.forward_backward([unit(t) for t in tenants])
        for t in tenants:
            engine.optim_step(t, {"learning_rate": 1e-4})
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
