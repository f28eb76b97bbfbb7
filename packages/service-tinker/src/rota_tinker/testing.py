"""Tiny real Hugging Face models for tests and benchmarks: built here, never downloaded.

``hf_snapshot`` writes a Qwen3- or Llama-architecture causal LM (random weights from a seed,
or a config alone, which the service random-inits) with a byte-level BPE tokenizer trained
on a few sentences, in the Hugging Face format; ``hub_cache_snapshot`` lays it out as the hub
cache does (``models--ORG--NAME/snapshots/REV`` and ``refs/main``), so ``rota serve tinker``
serves it under ``ORG/NAME`` and the SDK's ``get_tokenizer()`` loads it offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    """A tiny real Hugging Face causal LM (random weights from ``seed``, a local tokenizer) saved in ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = hf_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=128,
                  tie_word_embeddings=tie, eos_token_id=tok.eos_token_id, dtype=dtype)
    common.update(shape)  # e.g. a real model's shape: hidden_size, intermediate_size, heads, vocab_size
    config = Qwen3Config(**common) if arch == "qwen3" else LlamaConfig(**common)
    if weights:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(folder)
    else:  # a config alone (as a hub config.json has it): the service random-inits it from seed 0
        config.architectures = ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"]
        config.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def hub_cache_snapshot(cache: str | Path, name: str, **kwargs: Any) -> Path:
    """``hf_snapshot`` laid out as the hub cache does: ``models--ORG--NAME/snapshots/REV`` and ``refs/main``."""
    repo = Path(cache) / f"models--{name.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text("0123abcd")
    return hf_snapshot(repo / "snapshots" / "0123abcd", **kwargs)
