"""A TRL training job as a person would write it, run as a child process by test_trl_timeslice.py.

    python trl_job.py KIND SEED STEPS SLOW_S WORKDIR

KIND is ``grpo`` (GRPOTrainer, a Python reward), ``grpo_ref`` (GRPOTrainer with a KL term, so TRL keeps a
reference model: loaded from a local snapshot, as a path) or ``sft`` (SFTTrainer). Models are tiny Qwen3s
built from a config, the tokenizer a BPE trained here, the data in memory: nothing comes from a hub
(HF_HUB_OFFLINE=1). SLOW_S > 0 makes the reward sleep that long per call, wrapped in ``rota_trl.off_turn``.

Protocol (JSON lines on the original stdout; everything TRL prints goes to stderr): it prints
``{"ready": pid}``, then answers each stdin line: ``alone`` trains without rota, ``rota`` trains the same job
again with ``trainer.add_callback(rota_trl.RotaCallback(trainer))`` (the embedded orchestrator: no
ROTA_ORCHESTRATOR), ``exit`` ends it. Each answer has the per-step losses, rewards and grad norms, a
checksum of the final weights and, for ``rota``, the tenant's turn/park/restore events and the reward's
off-turn intervals (time.monotonic, one clock for every process of the machine).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

PROTO = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # TRL's and transformers' prints go to stderr, the protocol keeps the real stdout
os.environ.setdefault("HF_HUB_OFFLINE", "1")
KIND, SEED, STEPS, SLOW_S, WORKDIR = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
print(json.dumps({"ready": os.getpid()}), file=PROTO)

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

import rota_trl  # noqa: E402
from rota.admin import fetch_status  # noqa: E402

torch.set_num_threads(1)  # three jobs on two cores; the same kernels alone and time-sliced
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "one two three four five", "red green blue sky",
             "we train small models here", "turns are taken in order"]


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(SENTENCES * 20, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<|endoftext|>"], initial_alphabet=alphabet))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>",
                                   pad_token="<|endoftext|>")


TOK = tokenizer()


def tiny_qwen3(seed: int) -> torch.nn.Module:
    config = Qwen3Config(vocab_size=len(TOK), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                         eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def letters(completions: list[str], **kwargs: object) -> list[float]:
    """A fast reward: vowels per character."""
    return [sum(ch in "aeiou" for ch in c) / max(1, len(c)) for c in completions]


REWARD_INTERVALS: list[tuple[float, float]] = []


def slow_judge(completions: list[str], **kwargs: object) -> list[float]:
    """A slow host-side reward (a sandbox, a judge over HTTP): SLOW_S seconds per call."""
    t0 = time.monotonic()
    time.sleep(SLOW_S)
    out = [float(len(set(c))) / 10 for c in completions]
    REWARD_INTERVALS.append((t0, time.monotonic()))
    return out


def build(run: str):
    common = dict(output_dir=os.path.join(WORKDIR, f"{KIND}-{run}"), max_steps=STEPS, logging_steps=1, report_to=[],
                  use_cpu=True, bf16=False, save_strategy="no", seed=SEED, learning_rate=1e-2, disable_tqdm=True,
                  dataloader_num_workers=0)
    if KIND == "sft":
        data = Dataset.from_dict({"text": SENTENCES * 4})
        args = SFTConfig(per_device_train_batch_size=2, max_length=16, **common)
        return SFTTrainer(model=tiny_qwen3(SEED), args=args, train_dataset=data, processing_class=TOK)
    data = Dataset.from_dict({"prompt": SENTENCES * 4})
    reward = rota_trl.off_turn(slow_judge) if SLOW_S > 0 else letters
    args = GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                      beta=0.04 if KIND == "grpo_ref" else 0.0, **common)
    model: object = tiny_qwen3(SEED)
    if KIND == "grpo_ref":  # TRL builds the reference model from a path: a local snapshot
        path = os.path.join(WORKDIR, f"snapshot-{SEED}")
        if not os.path.isdir(path):
            model.save_pretrained(path)  # type: ignore[attr-defined]
        model = path
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=TOK)
    if KIND == "grpo_ref":  # on CPU, from_pretrained's tensors sit on the file's bytes, whose storage cannot be
        # freed, so rota could not park them: own copies (on a GPU, from_pretrained copies to the device anyway)
        for m in (trainer.model, trainer.ref_model):
            for p in m.parameters():
                p.data = p.data.clone()
    return trainer


def history(trainer: object) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]  # type: ignore[attr-defined]
    digest = hashlib.sha256()
    for _, p in sorted(trainer.model.named_parameters()):  # type: ignore[attr-defined]
        digest.update(p.detach().cpu().numpy().tobytes())
    return {"loss": [h["loss"] for h in logs], "reward": [h.get("reward") for h in logs],
            "grad_norm": [h.get("grad_norm") for h in logs], "weights": digest.hexdigest()}


def _marks(kind: str) -> int:
    return sum(n.endswith(kind) for n in os.listdir(WORKDIR))


class Arrived(TrainerCallback):  # the test's, not rota's: added before rota's callback
    """Marks that this job reached the start of training (its next call takes its first turn)."""

    def on_train_begin(self, args: object, state: object, control: object, **kwargs: object) -> None:
        open(os.path.join(WORKDIR, f"{os.environ['ROTA_TENANT']}.arrived"), "w").close()

    def on_train_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
        open(os.path.join(WORKDIR, f"{os.environ['ROTA_TENANT']}.ended"), "w").close()


class HandOffFirst(TrainerCallback):  # the test's, not rota's: added after rota's callback, runs in the turn
    """The first step starts once every job (``ROTA_TEST_JOBS``) has arrived and another one waits for the
    device (or every other job has ended), so the turn given back at that step goes to another job: each job
    is parked there and restored later. Why: six steps of the GRPO job with a KL term take 0.2 s alone, and on
    a loaded 2-core CI machine it once finished before the SFT job asked for a turn, so it was never parked.
    It holds the turn while it waits: the others' first turns queue behind it (``rota.admin.fetch_status``)."""

    def __init__(self, rota_callback: rota_trl.RotaCallback) -> None:
        self.rota, self.waited = rota_callback, False

    def on_step_begin(self, args: object, state: object, control: object, **kwargs: object) -> None:
        if self.waited:
            return
        self.waited = True
        gpu, jobs = self.rota.gpu, int(os.environ["ROTA_TEST_JOBS"])
        deadline = time.monotonic() + 120
        while _marks(".arrived") < jobs or not (
                any(g.queue for g in fetch_status(gpu.endpoint, gpu.group).groups) or _marks(".ended") == jobs - 1):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no other job queued for the device within 120 s ({WORKDIR})")
            time.sleep(0.02)


def train(run: str) -> dict:
    REWARD_INTERVALS.clear()
    trainer = build(run)
    callback = None
    if run == "rota":
        trainer.add_callback(Arrived())
        callback = rota_trl.RotaCallback(trainer)
        trainer.add_callback(callback)
        trainer.add_callback(HandOffFirst(callback))
    t0 = time.monotonic()
    trainer.train()
    out = history(trainer) | {"start": t0, "end": time.monotonic(), "reward_intervals": list(REWARD_INTERVALS)}
    if callback is not None:
        gpu = callback.gpu
        out |= {"tenant": gpu.tenant, "events": [list(e) for e in gpu.stats.events], "steps": callback.steps,
                "parks": len(gpu.stats.parks), "restores": len(gpu.stats.restores),
                "tracked": callback.tracked,
                "off_turn": [list(i) for i in callback.gate.intervals]}
    return out


for line in sys.stdin:
    cmd = line.strip()
    if cmd == "exit":
        break
    try:
        print(json.dumps(train(cmd)), file=PROTO)
    except Exception as exc:  # the test shows it, with the traceback on stderr
        import traceback

        traceback.print_exc()
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), file=PROTO)
