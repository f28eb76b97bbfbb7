"""What every module of a worker process shares: the worker's spec (what the HTTP process starts it with), the
micro-batch bound of a forward/backward, and the error that names the client's mistake. A module of its own so the
loop (:mod:`rota_tinker._worker.loop`), the roles (:mod:`rota_tinker._worker.roles`, :mod:`rota_tinker._worker.batch`)
and the HTTP process (:mod:`rota_tinker._http.handles`) import them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_NEW_TOKENS", "MAX_SAMPLES", "MAX_TOPK", "MICRO_BATCH_TOKENS", "MIN_TEMPERATURE", "UserError",
           "WorkerSpec"]

# A sample request's bounds, checked by the HTTP front end (rota_tinker._http.sampling) and again by the worker that
# reads them (rota_tinker._worker.sampling.check_params)
MAX_SAMPLES = 64  # num_samples
MAX_TOPK = 1000  # top-k, target ids per position and alternative tokens a sample request may ask for
MAX_NEW_TOKENS = 1024
# the lowest temperature above 0 (0 is greedy): logits / 1e-300 overflow float32, and the inf/NaN that gives once
# failed every row decoded beside it
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; picklable for ``spawn``."""

    tenant: str
    role: str  # "trainer" | "sampler" | "base" (.holder.BaseHolder) | "batch" (.batch.BatchTrainer)
    group: str
    endpoint: str | None
    device: str
    data_dir: str
    torch_threads: int = 1
    base: Any = None  # the BaseModelSpec a base holder holds (role "base" only)
    units_per_turn: int = 4  # queued units of this tenant that may share one turn
    release_cached: bool = True  # empty the CUDA cache after each park (ServiceConfig.release_cached)
    deterministic: bool = False  # torch.use_deterministic_algorithms (ServiceConfig.deterministic)
    lora_concurrency: int = 1  # > 1: LoRA units on a shared base run in its shared turn (._worker.shared_turn)
    shared_turn_job: str = ""  # a base holder's rota job id as its shared turn's tenant (lora_concurrency > 1)
    lora_batch_tokens: int = 0  # role "batch": the most tokens of one model in one batched pass


# tokens of one forward/backward micro-batch: bounds the float32 logits (~5 GB at a 150k vocabulary)
MICRO_BATCH_TOKENS = 8192


class UserError(Exception):
    """The request was wrong (reported to the client with category ``user``)."""
