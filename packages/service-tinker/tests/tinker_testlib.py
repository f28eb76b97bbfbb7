"""Helpers shared by rota-service-tinker's tests (a named module: other packages have conftest modules too)."""

from __future__ import annotations

import time

import numpy as np
import tinker
from tinker import types
from tinker.lib.api_future_impl import _APIFuture
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

from rota_tinker import BaseModelSpec

KEYS = {name: f"tml-{name}-test-key-0123" for name in ("alice", "bob", "carol", "dave")}
# A base big enough (about 80 MB) that a private copy of it per worker would stand out of a process's memory.
WIDE = BaseModelSpec("rota/wide", vocab=16384, dim=512, layers=1, heads=4, seed=3)


def full_training_client(sc: tinker.ServiceClient, base_model: str) -> TrainingClient:
    """A full-parameter TrainingClient: create_model without lora_config, through the SDK's own client.

    The SDK's public helpers only create LoRA models; the wire (CreateModelRequest.lora_config
    is optional) also allows full-parameter ones, which this service serves.
    """
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

    return holder.run_coroutine_threadsafe(create()).result(timeout=120)


def batch(step: int, seed: int, vocab: int = 128, n: int = 2, length: int = 12) -> list[types.Datum]:
    """A deterministic batch of next-token data for ``step``."""
    rng = np.random.default_rng([seed, step])
    out = []
    for _ in range(n):
        toks = rng.integers(0, vocab, size=length + 1)
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1].tolist()),
            loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(toks[1:].astype(np.int64)),
                            "weights": types.TensorData.from_numpy(np.ones(length, dtype=np.float32))}))
    return out

