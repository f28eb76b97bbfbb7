"""Hugging Face causal LMs served by their hub name, found in local directories (never downloaded).

Read by the HTTP process: ``config.json`` and the safetensors headers (a config-only snapshot is
counted on a model built on ``meta``, which imports transformers). Two layouts are recognised
under each directory searched:

* the hub cache (``models--Org--Name/snapshots/REV/``, ``REV`` from ``refs/main`` when it
  names a snapshot, else the newest snapshot), also below a ``hub/`` folder (``HF_HOME``);
* plain snapshot folders: the directory itself, ``DIR/Name/`` or ``DIR/Org/Name/`` holding a
  ``config.json`` (the model is then named ``Name`` or ``Org/Name``).

A folder is a model when its ``config.json`` names a ``...ForCausalLM`` architecture. Its
weights are its ``*.safetensors`` files; a snapshot without any is random-init from seed 0
(how the benchmarks build a 1.7B-shaped model from a config alone). The workers build
every model with ``transformers.AutoModelForCausalLM`` (:mod:`rota_tinker._worker.models`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from dataclasses import dataclass

from rota.errors import ConfigError

log = logging.getLogger(__name__)

_HUB_DIR = re.compile(r"models--([A-Za-z0-9][A-Za-z0-9._-]*)--([A-Za-z0-9][A-Za-z0-9._-]*)")
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_DTYPES = ("float32", "bfloat16", "float16")
_MAX_HEADER = 100 * 2**20  # a safetensors header larger than this is not read
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class HfModelSpec:
    """A Hugging Face causal LM in a local snapshot folder: what the service needs to serve it by its hub name.

    ``tokenizer_id`` is what ``get_info`` tells the SDK to load: the hub name, for every layout (a client
    sharing the hub cache loads it offline; one beside a plain ``ORG/NAME`` folder loads it from there).
    Never the server's path: a caller learns nothing of the server's file system.
    """

    name: str
    path: str  # the snapshot folder (config.json, *.safetensors, tokenizer files)
    vocab: int
    max_len: int
    dim: int
    layers: int
    dtype: str  # the config's dtype: float32, bfloat16 or float16
    n_params: int
    lora_shapes: tuple[tuple[str, int, int], ...]  # (group, in, out) of each LoRA-able linear of one layer
    eos_ids: tuple[int, ...]  # the implicit stop tokens (config and generation_config)
    tokenizer_id: str | None
    has_weights: bool
    seed: int = 0  # random init (no safetensors in the snapshot)

    def params(self) -> int:
        """Parameters of the model (from the safetensors headers, else from its config)."""
        return self.n_params

    def lora_params(self, rank: int, targets: dict[str, bool]) -> int:
        """Parameters of LoRA adapters of ``rank`` on the linears of ``targets`` (as peft builds them)."""
        per_layer = sum(rank * (i + o) for g, i, o in self.lora_shapes if g != "unembed" and targets.get(g))
        unembed = sum(rank * (i + o) for g, i, o in self.lora_shapes if g == "unembed" and targets.get(g))
        return self.layers * per_layer + unembed


def search_dirs(model_dirs: tuple[str, ...] | list[str], environ: dict[str, str] | None = None) -> list[str]:
    """The directories searched: ``model_dirs``, then the hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    env = os.environ if environ is None else environ
    cache = env.get("HF_HUB_CACHE") or os.path.join(env.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"),
                                                   "hub")
    out: list[str] = []
    for d in (*model_dirs, cache):
        d = os.path.abspath(d)
        if d not in out:
            out.append(d)
    return out


def find_models(dirs: list[str]) -> dict[str, HfModelSpec]:
    """Every causal LM under ``dirs`` by its hub name (the first directory naming one wins)."""
    found: dict[str, HfModelSpec] = {}
    for d in dirs:
        if not os.path.isdir(d):
            continue
        for name, snapshot, hub in _snapshots(d):
            if name in found:
                continue
            try:
                spec = read_snapshot(name, snapshot, hub=hub)
            except ConfigError as e:
                log.warning("%s", e)
                continue
            if spec is not None:
                found[name] = spec
    return found


def _snapshots(d: str) -> list[tuple[str, str, bool]]:
    """(hub name, snapshot folder, from the hub cache) of every candidate model folder in ``d``."""
    out: list[tuple[str, str, bool]] = []
    for cache in (d, os.path.join(d, "hub")):
        if not os.path.isdir(cache):
            continue
        for entry in sorted(os.listdir(cache)):
            m = _HUB_DIR.fullmatch(entry)
            if m:
                snap = _hub_snapshot(os.path.join(cache, entry))
                if snap is not None:
                    out.append((f"{m.group(1)}/{m.group(2)}", snap, True))
    if os.path.isfile(os.path.join(d, "config.json")):
        out.append((os.path.basename(d), d, False))
    for a in sorted(os.listdir(d)):
        pa = os.path.join(d, a)
        if not _PART.fullmatch(a) or a.startswith("models--") or not os.path.isdir(pa) or os.path.islink(pa):
            continue
        if os.path.isfile(os.path.join(pa, "config.json")):
            out.append((a, pa, False))
            continue
        for b in sorted(os.listdir(pa)):
            pb = os.path.join(pa, b)
            if _PART.fullmatch(b) and os.path.isfile(os.path.join(pb, "config.json")):
                out.append((f"{a}/{b}", pb, False))
    return out


def _hub_snapshot(repo: str) -> str | None:
    """The snapshot of a hub-cache repo folder: the one ``refs/main`` names, else the newest."""
    snaps = os.path.join(repo, "snapshots")
    if not os.path.isdir(snaps):
        return None
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            rev = f.read(128).strip()
        if _PART.fullmatch(rev) and os.path.isdir(os.path.join(snaps, rev)):
            return os.path.join(snaps, rev)
    except OSError:
        pass
    revs = [os.path.join(snaps, r) for r in os.listdir(snaps) if _PART.fullmatch(r)]
    return max(revs, key=os.path.getmtime) if revs else None


def _load_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model folder {os.path.dirname(path)!r}: cannot read {os.path.basename(path)} ({e})") \
            from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path!r} is not a JSON object")
    return data


def read_snapshot(name: str, folder: str, *, hub: bool) -> HfModelSpec | None:
    """The spec of the causal LM in ``folder`` (None when it is not one); ConfigError naming a bad file."""
    cfg = _load_json(os.path.join(folder, "config.json"))
    archs = cfg.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs):
        log.debug("%s: %s is not a causal LM (architectures %s); skipped", name, folder, archs)
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg

    def num(key: str, default: int | None = None) -> int:
        value = text.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"model {name!r} ({folder}): config.json {key}={value!r} must be a positive integer")
        return value

    dim, vocab, layers = num("hidden_size"), num("vocab_size"), num("num_hidden_layers")
    heads = num("num_attention_heads")
    kv = num("num_key_value_heads", heads)
    head_dim = text.get("head_dim") or dim // heads
    inter = num("intermediate_size")
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    if dtype not in _DTYPES:
        raise ConfigError(f"model {name!r} ({folder}): dtype {dtype!r} is not one of {list(_DTYPES)}")
    shapes = (("attn", dim, heads * head_dim), ("attn", dim, kv * head_dim), ("attn", dim, kv * head_dim),
              ("attn", heads * head_dim, dim), ("mlp", dim, inter), ("mlp", dim, inter), ("mlp", inter, dim),
              ("unembed", dim, vocab))
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    n_params = (sum(_safetensors_numel(os.path.join(folder, f)) for f in files) if files
                else _meta_params(name, folder))
    eos: list[int] = []
    gen = os.path.join(folder, "generation_config.json")
    for source in (cfg, _load_json(gen) if os.path.isfile(gen) else {}):
        ids = source.get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and 0 <= i < vocab and i not in eos:
                eos.append(i)
    has_tokenizer = any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)
    return HfModelSpec(name=name, path=folder, vocab=vocab, max_len=num("max_position_embeddings", 2048), dim=dim,
                       layers=layers, dtype=dtype, n_params=n_params, lora_shapes=shapes, eos_ids=tuple(eos),
                       tokenizer_id=name if has_tokenizer else None, has_weights=bool(files))


def _meta_params(name: str, folder: str) -> int:
    """Parameters of a config-only snapshot, counted on a model built on ``meta`` (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # an architecture this transformers does not know, a bad config
        raise ConfigError(f"model {name!r} ({folder}): transformers cannot build it ({type(e).__name__}: {e})") \
            from None
    return sum(p.numel() for p in model.parameters())


def _safetensors_numel(path: str) -> int:
    """Elements of every tensor in a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ConfigError(f"{path!r} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER:
            raise ConfigError(f"{path!r}: safetensors header of {size} bytes is too large")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise ConfigError(f"{path!r}: safetensors header is not JSON ({e})") from None
    total = 0
    for key, info in header.items():
        if key == "__metadata__" or not isinstance(info, dict):
            continue
        n = 1
        for s in info.get("shape", []):
            n *= int(s)
        total += n
    return total
