"""Tiny deterministic Megatron-Core GPT training shared by the worker (CPU, gloo, with cpu_shim).

Modes:
* ``plain`` — two GPTModel chunks (a list, as ``get_model`` returns) and a torch AdamW;
  grads all-reduced by hand over the data-parallel group.
* ``distopt`` — one chunk in Megatron DDP (contiguous param/grad buffers) with the
  DistributedOptimizer (fp32 params; each rank holds half the optimizer shard).
* ``distopt-bf16`` — the same with bf16 params: fp32 main params are separate shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH = 64, 16, 2


def build(mode: str, seed: int = 0) -> tuple[list[torch.nn.Module], Any]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    bf16 = mode == "distopt-bf16"
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
                            params_dtype=torch.bfloat16 if bf16 else torch.float32,
                            pipeline_dtype=torch.bfloat16 if bf16 else torch.float32)
    torch.manual_seed(seed)
    n_chunks = 2 if mode == "plain" else 1
    chunks: list[torch.nn.Module] = [GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                                              vocab_size=VOCAB, max_sequence_length=SEQ) for _ in range(n_chunks)]
    if mode == "plain":
        opt = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-2, weight_decay=0.01)
        return chunks, opt
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if bf16:
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(cfg, c) for c in chunks]
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    chunks = [DistributedDataParallel(cfg, ddp_cfg, c) for c in chunks]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, bf16=bf16,
                                                 use_distributed_optimizer=True, clip_grad=1.0), chunks)
    return chunks, opt


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
    return tokens, position, mask


def train_step(mode: str, chunks: list[torch.nn.Module], opt: Any, step: int, rank: int) -> torch.Tensor:
    tokens, position, mask = batch(step, rank)
    if mode == "plain":
        opt.zero_grad()
    else:
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
    loss = sum(c(tokens, position, mask, labels=tokens).float().mean() for c in chunks)
    loss.backward()
    if mode == "plain":
        for c in chunks:
            for p in c.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
    else:
        for c in chunks:
            c.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
    return loss.detach().clone()


def snapshot(chunks: list[torch.nn.Module], opt: Any) -> dict[str, torch.Tensor]:
    """Parameters, buffers, DDP grad buffers, main params and optimizer state, cloned."""
    from rota_megatron import ddp_buffers, leaf_optimizers

    out: dict[str, torch.Tensor] = {}
    for i, c in enumerate(chunks):
        for n, t in list(c.named_parameters()) + list(c.named_buffers()):
            out[f"chunk{i}.{n}"] = t.detach().clone()
        for j, b in enumerate(ddp_buffers(c)):
            out[f"chunk{i}.buf{j}.grad_data"] = b.grad_data.clone()
    for k, leaf in enumerate(leaf_optimizers(opt)):
        inner = leaf if isinstance(leaf, torch.optim.Optimizer) else leaf.optimizer
        for m, p in enumerate(p for g in inner.param_groups for p in g["params"]):
            out[f"opt{k}.main{m}"] = p.detach().clone()
            for key, v in inner.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"opt{k}.state{m}.{key}"] = v.clone()
    return out
