"""rota's methods in every vLLM worker of a served engine (``--worker-extension-cls``), called over ``/collective_rpc``.

Why: ``rota vllm serve`` (``--backup rota``, the default) keeps the weights over an offload park in rota's pinned
host pool instead of vLLM's level-1 backup, as ``rota_vllm.track`` does in-process (:mod:`rota_vllm._pinned`). The
engine's command line names this class, so vLLM mixes these methods into each worker; a worker extension of your
own must subclass this one to keep them.
"""

from __future__ import annotations

from rota_vllm._pinned import worker_load, worker_prepare, worker_release, worker_save


class RotaWorkerExtension:
    """``rota_prepare`` (reserve the pool; the bytes it keeps), ``rota_save``, ``rota_load``, ``rota_release``."""

    def rota_prepare(self) -> int:
        return worker_prepare(self)

    def rota_save(self) -> float:
        return worker_save(self)

    def rota_load(self) -> float:
        return worker_load(self)

    def rota_release(self) -> None:
        worker_release(self)


__all__ = ["RotaWorkerExtension"]
