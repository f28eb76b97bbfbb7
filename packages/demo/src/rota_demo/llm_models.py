"""The LLM mode's models (``rota demo --engine hf|vllm``): Qwen3-architecture shapes per job, the starting
checkpoints built in the run (no model hub) and cached on disk, and the trainer's two step functions (a GRPO
policy-gradient step, an SFT step split into microbatches).

Checkpoints: a ``transformers.Qwen3Config`` of the job's shape, random weights from the job's seed, pre-trained
for ``pretrain_steps`` on correct examples of the job's task (a short warm start: the model knows the format and
answers some questions, so RL has rewards to raise), or until ``pretrain_reward`` is reached: a sample at
temperature 1 is exactly right with the model's probability of the answer, so the mean of that probability over a
fresh batch is the reward a rollout would average, measured before each step, and a large shape that would
otherwise start near-perfect (and leave its rewards nothing to rise to) stops at a chosen one. Then
``save_pretrained`` with the character-level tokenizer of :mod:`rota_demo.llm_tasks`. Trainer and engine both
load it with ``from_pretrained``. The directory is named by a hash of everything that determines its bytes
(shape, task, seed, pre-training), so a repeated run finds it and skips the build.

Imports torch and transformers: only the LLM mode loads this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import shutil
from dataclasses import dataclass

import torch

from rota_demo import llm_tasks as t

__all__ = ["CKPT_VERSION", "PRESETS", "START_REWARD", "LlmSize", "build_checkpoint", "examples", "grpo_step",
           "load_trainer", "own_storages", "rollout_batch", "sft_step"]

CKPT_VERSION = 1  # bump when the build below changes what it writes


@dataclass(frozen=True)
class LlmSize:
    """One job's model shape and loop sizes; ``ckpt`` is set once its checkpoint exists."""

    task: str
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 32  # vLLM's attention backends take head sizes from 32 up (FlashAttention: 32, 64, ... 256)
    intermediate: int = 128
    prompts: int = 32  # questions per step
    group: int = 8  # G: samples per question (GRPO group); the SFT job trains on prompts x group examples
    lr: float = 1e-3
    pretrain_steps: int = 30
    pretrain_lr: float = 3e-3
    pretrain_reward: float = 0.0  # stop pre-training once a temperature-1 sample is right this often; 0: never
    engine_memory: float = 0.1  # vLLM's gpu_memory_utilization for this job's engine (its share of the device)
    ckpt: str = ""

    @property
    def batch(self) -> int:
        """Sequences per trainer step (the SFT microbatches split this)."""
        return self.prompts * self.group

    @property
    def params(self) -> int:
        """Parameters of the Qwen3 shape (embedding tied to the output head, as Qwen3-0.6B/1.7B/4B)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + 2 * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return t.VOCAB * self.hidden + self.layers * (attn + mlp + 2 * self.hidden) + self.hidden

    @property
    def trainer_state_bytes(self) -> int:
        """fp32 weights + grads + two AdamW moments."""
        return self.params * 16

    @property
    def weight_bytes(self) -> int:
        """fp32 weights: what the HF stand-in engine holds and parks."""
        return self.params * 4

    @property
    def push_bytes(self) -> int:
        """The trainer -> engine push buffer of the fp32 state dict (the ``hf`` stand-in's)."""
        return self.push_bytes_as(None)

    def push_bytes_as(self, dtype: str | None) -> int:
        """The push buffer with its tensors in ``dtype`` (None: fp32, the trainer's): the state dict (the tied
        head listed twice) laid out as :meth:`rota_demo.push.WeightPush.bind` does; from the model built on the
        meta device (no memory)."""
        from transformers import Qwen3ForCausalLM

        from rota_demo.push import push_bytes, travel_dtype

        with torch.device("meta"):
            model = Qwen3ForCausalLM._from_config(self.config(), dtype=torch.float32)
        return push_bytes([(v.numel(), travel_dtype(v.dtype, dtype).itemsize) for v in model.state_dict().values()])

    def engine_footprint(self, engine: str, total: int) -> int:
        """Device bytes this job's engine holds awake on a device of ``total`` bytes, as its adapter reports once
        it is tracked (vLLM: ``rota_vllm.awake_footprint`` of ``engine_memory``; the hf stand-in: its fp32
        weights). Given to rota as the engine's footprint hint, so that the turn it starts in makes room for it."""
        if engine == "vllm":
            import rota_vllm

            return rota_vllm.awake_footprint(self.engine_memory, total)
        return self.weight_bytes

    def device_bytes(self, engine: str, total: int) -> int:
        """Device bytes this job holds at its peak on a device of ``total`` bytes: the trainer's state, the bf16
        copy of its weights that its autocast step makes, and its engine (vLLM: ``engine_memory`` of the device;
        the hf stand-in: its fp32 weights). Contexts and activations are what a capacity's margin is for."""
        held = self.engine_memory * total if engine == "vllm" else self.weight_bytes
        return self.trainer_state_bytes + self.params * 2 + int(held)

    @property
    def engine_pool_bytes(self) -> int:
        """bf16 weights: the pinned copy a vLLM engine's park keeps in rota's pool (reserved when it is tracked)."""
        return self.params * 2

    def config(self):  # -> transformers.Qwen3Config
        from transformers import Qwen3Config

        return Qwen3Config(vocab_size=t.VOCAB, hidden_size=self.hidden, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate, max_position_embeddings=64, tie_word_embeddings=True,
                           bos_token_id=t.BOS, eos_token_id=t.EOS, pad_token_id=t.PAD, rope_theta=10000.0,
                           torch_dtype="float32")

    def key(self, seed: int) -> str:
        """What determines the checkpoint's bytes, hashed: its directory name."""
        shape = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("prompts", "group", "lr", "ckpt",
                                                                                 "engine_memory")}
        if not self.pretrain_reward:  # unset: the key it had before the field existed
            del shape["pretrain_reward"]
        blob = json.dumps({"v": CKPT_VERSION, "seed": seed, **shape}, sort_keys=True)
        return f"{self.task}-{self.params / 1e6:.1f}M-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def _tiny(task: str, lr: float = 1e-3, pretrain_steps: int = 30) -> LlmSize:
    return LlmSize(task=task, lr=lr, pretrain_steps=pretrain_steps)


#: Where the large shapes' pre-training stops: 60 steps took Qwen3-0.6B's shape to a mean reward of 0.94 and the
#: 1.7B's to 0.93 on an H200 (50d40b9), where GRPO's groups are mostly all right (no advantage) and nothing can
#: visibly rise; at 0.3 a group of 8 has a right and a wrong sample most of the time.
START_REWARD = 0.3

_QWEN3_06B_SHIFT = LlmSize("shift", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                           prompts=32, group=8, lr=1e-5, pretrain_steps=60, pretrain_lr=1e-4,
                           pretrain_reward=START_REWARD, engine_memory=0.10)
_QWEN3_17B_REV = LlmSize("rev", hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
                         prompts=32, group=8, lr=5e-6, pretrain_steps=60, pretrain_lr=5e-5,
                         pretrain_reward=START_REWARD, engine_memory=0.12)


def _qwen3_4b_sort(layers: int, engine_memory: float) -> LlmSize:
    """The SFT job on Qwen3-4B's shape with ``layers`` blocks (36: the 4B itself)."""
    return LlmSize("sort", hidden=2560, layers=layers, heads=32, kv_heads=8, head_dim=128, intermediate=9728,
                   prompts=32, group=8, lr=3e-6, pretrain_steps=60, pretrain_lr=3e-5,
                   pretrain_reward=START_REWARD, engine_memory=engine_memory)


#: --llm-size: the three jobs' shapes (rl-a, rl-b, sft). ``tiny`` runs on CPU in CI (about 76 k parameters
#: each, so a step takes milliseconds; measured on CPU over 16 steps, mean reward of the first four -> the
#: last four: shift 0.41 -> 0.62, rev 0.50 -> 0.69; SFT accuracy 0.75 -> 0.91); ``h200`` is Qwen3-0.6B, -1.7B
#: and -4B's shapes (vocabulary aside: the tasks' 32 tokens), about 0.44 B, 1.4 B and 3.6 B parameters, for one
#: H200 (run there at 50d40b9): trainer states of 82 GiB and engines given 42% of the device (59 GiB awake, 64 GiB
#: as their footprints count it) exceed what ``--capacity auto`` leaves (126 GiB), so the policy must park; the
#: largest job alone needs 89 GiB, which an 80 GB card does not have (the demo refuses it there, naming why).
#: ``h100`` is the same experiment sized for one 80 GB card: rl-a and rl-b as in ``h200``, the SFT job a 20-layer
#: cut of the 4B shape (about 2.0 B parameters); alone they need 15, 33 and 43 GiB, together their trainer states
#: and engines' shares (85 GiB) exceed what ``--capacity auto`` leaves there (72 GiB) by more than the smallest
#: trainer state, so the policy must park trainers, not only engines.
PRESETS: dict[str, tuple[LlmSize, LlmSize, LlmSize]] = {
    "tiny": (_tiny("shift"), _tiny("rev", pretrain_steps=40), _tiny("sort", lr=3e-3)),
    "h200": (_QWEN3_06B_SHIFT, _QWEN3_17B_REV, _qwen3_4b_sort(36, 0.20)),
    "h100": (_QWEN3_06B_SHIFT, _QWEN3_17B_REV, _qwen3_4b_sort(20, 0.12)),
}


def examples(task: str, seed: int, step: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Supervised batch: (tokens (count, PROMPT_LEN + MAX_NEW), mask of the predicted answer positions)."""
    rows, masks = [], []
    for q in t.prompts(task, seed, step, count):
        ans = [*t.encode(t.answer(q)), t.EOS]
        row = [t.BOS, *t.encode(q), *ans]
        rows.append(row + [t.PAD] * (t.PROMPT_LEN + t.MAX_NEW - len(row)))
        masks.append([0.0] * (t.PROMPT_LEN - 1) + [1.0] * len(ans) + [0.0] * (t.MAX_NEW - len(ans)))
    return torch.tensor(rows), torch.tensor(masks)


def rollout_batch(completions: list[list[int]], questions: list[str], group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine samples (``group`` per question, in order) as the trainer's (tokens, completion mask)."""
    rows, masks = [], []
    for i, comp in enumerate(completions):
        comp = list(comp[:t.MAX_NEW])
        if t.EOS in comp:
            comp = comp[:comp.index(t.EOS) + 1]
        row = [t.BOS, *t.encode(questions[i // group]), *comp]
        rows.append(row + [t.PAD] * (t.PROMPT_LEN + t.MAX_NEW - len(row)))
        masks.append([0.0] * (t.PROMPT_LEN - 1) + [1.0] * len(comp) + [0.0] * (t.MAX_NEW - len(comp)))
    return torch.tensor(rows), torch.tensor(masks)


def _logp(model, tokens: torch.Tensor) -> torch.Tensor:
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if tokens.is_cuda else torch.autocast("cpu",
                                                                                                enabled=False)
    with autocast:
        logits = model(input_ids=tokens[:, :-1]).logits
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def grpo_step(model, opt, tokens: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor, group: int) -> float:
    """One GRPO update, on-policy (one step per rollout, so the importance ratio is 1 and no clipping applies):
    advantage = reward - its group's mean, over the group's std (+1e-4); loss = -mean over completion tokens of
    advantage x log-prob. Returns the loss."""
    r = rewards.view(-1, group)
    adv = ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).view(-1)
    loss = -(adv.unsqueeze(1) * _logp(model, tokens) * mask).sum() / mask.sum().clamp(min=1.0)
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    return float(loss.item())


def sft_step(model, opt, tokens: torch.Tensor, mask: torch.Tensor, parts: int, turn) -> float:
    """Cross-entropy on the answer tokens, in ``parts`` equal microbatches, each inside ``turn(last)`` (the
    worker's device phase), then one optimizer step in the last. Returns the step's loss."""
    total = 0.0
    for i, (x, m) in enumerate(zip(tokens.chunk(parts), mask.chunk(parts), strict=True)):
        last = i == parts - 1
        with turn(last):
            if i == 0:
                opt.zero_grad(set_to_none=False)
            dev = next(model.parameters()).device
            x, m = x.to(dev), m.to(dev)
            loss = -(_logp(model, x) * m).sum() / m.sum().clamp(min=1.0) / parts
            loss.backward()
            total += float(loss.item())
            if last:
                opt.step()
    return total


def load_trainer(size: LlmSize, device: str, *, optimizer: bool):
    """The checkpoint as the trainer's model (fp32, eager attention: deterministic) and AdamW."""
    from transformers import Qwen3ForCausalLM

    model = own_storages(Qwen3ForCausalLM.from_pretrained(size.ckpt, dtype=torch.float32,
                                                          attn_implementation="eager", device_map=device))
    # fused on CUDA: one kernel per step and no foreach temporaries (a quarter of the state again, 13 GiB at 4B)
    opt = torch.optim.AdamW(model.parameters(), lr=size.lr, weight_decay=0.0,
                            fused=device.startswith("cuda") or None) if optimizer else None
    return model, opt


def own_storages(model):
    """``model`` with every parameter and buffer in a storage of its own: ``from_pretrained`` on CPU leaves
    them in the safetensors file's memory map, whose storages cannot be resized, so rota could not park them.
    Ties (the embedding and the output head) are kept: they are one parameter."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
        for mod in model.modules():
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = b.clone()
    return model


RECORD = "rota-demo.json"  # written beside a checkpoint's weights by build_checkpoint: how they were pre-trained


def checkpoint_record(ckpt: str) -> dict | None:
    """The record :func:`build_checkpoint` wrote with checkpoint ``ckpt`` (None: no checkpoint, or not the demo's)."""
    record = pathlib.Path(ckpt, RECORD)
    return json.loads(record.read_text()) if ckpt and record.is_file() else None


def build_checkpoint(size: LlmSize, seed: int, device: str, cache_dir: str) -> tuple[str, bool]:
    """(path, built): the job's starting checkpoint under ``cache_dir``, built unless it is there already."""
    path = pathlib.Path(cache_dir) / size.key(seed)
    if (path / RECORD).exists():
        return str(path), False
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(size.config(), attn_implementation="eager", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=size.pretrain_lr)
    losses, rewards = [], []
    for step in range(size.pretrain_steps):
        tokens, mask = examples(size.task, seed + 7919, step, 64)  # other questions than the run's
        # a warm-up of the learning rate over the first tenth, then constant
        for g in opt.param_groups:
            g["lr"] = size.pretrain_lr * min(1.0, (step + 1) / max(1, math.ceil(size.pretrain_steps / 10)))
        tokens, mask = tokens.to(device), mask.to(device)
        logp = _logp(model, tokens) * mask
        # this batch is new to the model: its mean probability of the exact answer is a rollout's expected reward
        rewards.append(float(logp.sum(dim=1).exp().mean().item()))
        if size.pretrain_reward and rewards[-1] >= size.pretrain_reward:
            break
        loss = -logp.sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config.do_sample = False  # the demo passes its own settings; keep the saved ones plain
    model.save_pretrained(tmp)
    t.save_tokenizer(str(tmp))
    (tmp / RECORD).write_text(json.dumps({"size": dataclasses.asdict(size), "seed": seed,
                                                    "params": size.params, "pretrain_losses": losses,
                                                    "pretrain_expected_rewards": rewards}, indent=1))
    try:
        os.replace(tmp, path)
    except OSError:  # another run built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path), True
