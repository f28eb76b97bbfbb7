"""A minimal supervised fine-tuning loop written the way the tinker-cookbook writes its ``recipes/sl_loop.py``.

Renderer-free (a plain "role: content" template, trained on assistant turns only) and reading a
local JSONL of conversations instead of a hub dataset; otherwise the recipe's shape: tokenizer
from the model name, resume from the last saved state, a linear learning-rate schedule,
forward_backward + optim_step per batch, mean NLL per step, a checkpoint every ``save_every``
batches and at the end (state and sampler weights). Run as the cookbook's are, ``key=value``
arguments overriding :class:`Config`::

    python sl_loop.py base_url=http://127.0.0.1:8000 model_name=Qwen/Qwen3-0.6B data=conversations.jsonl

It prints one JSON line per step and ``checkpoints.jsonl`` in ``log_path`` lists what it saved.
"""

import dataclasses
import json
import os
import sys
import time

import numpy as np
import tinker
from transformers import AutoTokenizer


@dataclasses.dataclass
class Config:
    base_url: str | None = None
    log_path: str = "/tmp/tinker-examples/sl-loop"
    model_name: str = "Qwen/Qwen3-0.6B"
    data: str = "conversations.jsonl"
    batch_size: int = 2
    learning_rate: float = 1e-2
    max_length: int = 120
    lora_rank: int = 8
    save_every: int = 2
    stop_after: int = -1  # stop after this many batches (to show resuming); -1: run the epoch


def conversation_to_datum(messages: list[dict], tokenizer, max_length: int) -> tinker.Datum:
    """Tokens of "role: content" turns; weight 1 on assistant turns (what is learned), 0 elsewhere."""
    tokens, weights = [], []
    for m in messages:
        ids = tokenizer.encode(f"{m['role']}: {m['content']}\n", add_special_tokens=False)
        tokens += ids
        weights += [1.0 if m["role"] == "assistant" else 0.0] * len(ids)
    tokens, weights = tokens[:max_length + 1], weights[:max_length + 1]
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                        "weights": np.asarray(weights[1:], np.float32)})


def compute_mean_nll(logprobs, weights) -> float:
    total = sum(float(np.dot(np.asarray(lp.tolist()), np.asarray(w.tolist())))
                for lp, w in zip(logprobs, weights, strict=True))
    return -total / max(sum(float(np.sum(w.tolist())) for w in weights), 1.0)


def get_last_checkpoint(log_path: str) -> dict | None:
    path = os.path.join(log_path, "checkpoints.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "state_path" in r]
    return rows[-1] if rows else None


def save_checkpoint(training_client, name: str, log_path: str, kind: str, loop_state: dict) -> dict:
    row = {"name": name, **loop_state}
    if kind in ("state", "both"):
        row["state_path"] = training_client.save_state(name).result().path
    if kind in ("sampler", "both"):
        row["sampler_path"] = training_client.save_weights_for_sampler(name).result().path
    with open(os.path.join(log_path, "checkpoints.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def main(config: Config) -> None:
    os.makedirs(config.log_path, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(config.model_name)
    with open(config.data) as f:
        train_dataset = [json.loads(line) for line in f if line.strip()]
    n_train_batches = len(train_dataset) // config.batch_size

    service_client = tinker.ServiceClient(base_url=config.base_url)
    resume_info = get_last_checkpoint(config.log_path)
    if resume_info:
        training_client = service_client.create_training_client_from_state_with_optimizer(
            resume_info["state_path"]).result()
        start_batch = resume_info["batch"]
    else:
        training_client = service_client.create_lora_training_client(
            base_model=config.model_name, rank=config.lora_rank, seed=0).result()
        start_batch = 0

    for batch_idx in range(start_batch, n_train_batches):
        if config.stop_after >= 0 and batch_idx - start_batch >= config.stop_after:
            return
        start_time = time.time()
        step = batch_idx
        if step % config.save_every == 0 and step > 0:
            save_checkpoint(training_client, f"{step:06d}", config.log_path, "state", {"batch": batch_idx})
        lr_mult = max(0.0, 1.0 - step / n_train_batches)
        current_lr = config.learning_rate * lr_mult
        adam_params = tinker.AdamParams(learning_rate=current_lr, beta1=0.9, beta2=0.95, eps=1e-8)
        rows = train_dataset[batch_idx * config.batch_size:(batch_idx + 1) * config.batch_size]
        batch = [conversation_to_datum(row["messages"], tokenizer, config.max_length) for row in rows]

        fwd_bwd_future = training_client.forward_backward(batch, loss_fn="cross_entropy")
        optim_step_future = training_client.optim_step(adam_params)
        fwd_bwd_result = fwd_bwd_future.result()
        optim_step_future.result()

        train_logprobs = [x["logprobs"] for x in fwd_bwd_result.loss_fn_outputs]
        train_weights = [d.loss_fn_inputs["weights"] for d in batch]
        print(json.dumps({"step": step, "train_mean_nll": compute_mean_nll(train_logprobs, train_weights),
                          "learning_rate": current_lr, "num_sequences": len(batch),
                          "time_total": time.time() - start_time}), flush=True)

    save_checkpoint(training_client, "final", config.log_path, "both", {"batch": n_train_batches})


if __name__ == "__main__":
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
    overrides = dict(arg.split("=", 1) for arg in sys.argv[1:])
    main(Config(**{k: fields[k](v) if fields[k] in (int, float) else v for k, v in overrides.items()}))
