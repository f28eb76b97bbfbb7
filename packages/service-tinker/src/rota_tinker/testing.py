"""Tiny real Hugging Face models for tests and benchmarks: built here, never downloaded.

``hf_snapshot`` writes a Qwen3- or Llama-architecture causal LM (random weights from a seed,
or a config alone, which the service random-inits) with a byte-level BPE tokenizer trained
on a few sentences, in the Hugging Face format; ``hub_cache_snapshot`` lays it out as the hub
cache does (``models--ORG--NAME/snapshots/REV`` and ``refs/main``), so ``rota tinker serve``
serves it under ``ORG/NAME`` and the SDK's ``get_tokenizer()`` loads it offline.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rota_tinker._hf import HfModelSpec, find_models

# Shapes of Qwen3 models (their hub config.json), for config-only snapshots the service random-inits
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1024),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie=False),  # its own lm_head
}

SENTENCES = ["the quick brown fox jumps over the lazy dog.", "hello world, stop here.", "a tiny model learns to talk.",
             "user: hi there\nassistant: hello, how can i help?"]


def hf_tokenizer(vocab: int = 300) -> Any:
    """A byte-level BPE tokenizer trained here on a few sentences (no download), as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>",
                                   pad_token="<|endoftext|>")


def hf_snapshot(folder: str | Path, arch: str = "qwen3", *, seed: int = 0, hidden: int = 32, layers: int = 2,
                tie: bool = False, dtype: str = "float32", weights: bool = True, **shape: Any) -> Path:
    """A tiny real Hugging Face causal LM of model type ``arch`` (random weights from ``seed``, a local tokenizer)
    saved in ``folder``; ``weights=False`` saves its config alone."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = hf_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=128,
                  tie_word_embeddings=tie, eos_token_id=tok.eos_token_id, dtype=dtype)
    common.update(shape)  # e.g. a real model's shape: hidden_size, intermediate_size, heads, vocab_size
    config = AutoConfig.for_model(arch, **common)  # qwen3, llama, qwen2, gemma, gemma3_text, mistral, ...
    if weights:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(folder)
    else:  # a config alone (as a hub config.json has it): the service random-inits it from seed 0
        config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
        config.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def hub_cache_snapshot(cache: str | Path, name: str, **kwargs: Any) -> Path:
    """``hf_snapshot`` laid out as the hub cache does: ``models--ORG--NAME/snapshots/REV`` and ``refs/main``."""
    repo = Path(cache) / f"models--{name.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text("0123abcd")
    return hf_snapshot(repo / "snapshots" / "0123abcd", **kwargs)


def qwen3_shaped(cache: str | Path, shape: str, dtype: str = "bfloat16", *, weights: bool = False) -> HfModelSpec:
    """A hub-cache snapshot ``bench/SHAPE`` of a Qwen3 shape, as served: config-only (the service random-inits it
    from seed 0), or with ``weights`` (random weights written with ``save_pretrained``, which workers load with
    ``from_pretrained``: the path users take)."""
    dims = dict(QWEN3_SHAPES[shape])
    tie = dims.pop("tie", True)  # Qwen3 up to 4B ties the head to the embeddings; 8B does not
    hub_cache_snapshot(cache, f"bench/{shape}", weights=weights, dtype=dtype, tie=tie, max_position_embeddings=40960,
                       **dims)
    return find_models([str(cache)])[f"bench/{shape}"]


def full_training_client(sc: Any, base_model: str, timeout_s: float = 120) -> Any:
    """A full-parameter TrainingClient: create_model without lora_config, through the SDK's own client.

    The SDK's public helpers only create LoRA models; the wire (CreateModelRequest.lora_config
    is optional) also allows full-parameter ones, which this service serves.
    """
    from tinker import types
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

    holder = sc.holder
    seq = holder.get_training_client_id()

    async def create() -> TrainingClient:
        with holder.aclient(ClientConnectionPoolType.TRAIN) as c:
            untyped = await c.models.create(request=types.CreateModelRequest(
                session_id=holder.get_session_id(), model_seq_id=seq, base_model=base_model, lora_config=None))
        resp = await _APIFuture(types.CreateModelResponse, holder, untyped, request_start_time=time.time(),
                                request_type="CreateModel").result_async()
        info = await fetch_training_info(holder, resp.model_id)
        return TrainingClient(holder, model_seq_id=seq, model_id=resp.model_id, info=info)

    return holder.run_coroutine_threadsafe(create()).result(timeout=timeout_s)


@contextlib.contextmanager
def serving_process(args: Sequence[str], env: Mapping[str, str], *,
                    timeout_s: float = 60.0) -> Iterator[tuple[subprocess.Popen, str, list[str]]]:
    """``rota tinker serve ARGS`` in a process of its own, as an operator runs it, until the block ends.

    Yields (the process, its ``rota tinker: serving ...`` line, the list its stderr keeps filling);
    at the end it is stopped with SIGINT, then killed if it does not exit within a minute.
    """
    cmd = [sys.executable, "-m", "rota", "tinker", "serve", *args]
    proc = subprocess.Popen(cmd, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    started = threading.Event()

    def drain() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if "rota tinker: serving" in line:
                started.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert started.wait(timeout_s), "".join(lines)
        yield proc, next(line for line in lines if "rota tinker: serving" in line), lines
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
