"""One worker process: the trainer or the sampler of one tenant.

Started by :mod:`rota_tinker._http.handles` with the ``spawn`` method; talks to the HTTP
process over a ``multiprocessing`` pipe: requests ``(request_id, op, args)``, replies
``(request_id, "ok", result, timing)`` or ``(request_id, "err", message, category,
timing)``; ``None`` asks it to exit. Work units run in arrival order (queued samples together).

Every device work unit (creating a model, ``forward_backward``, ``optim_step``, a
sampling batch) runs inside a turn of the tenant's rota tenant (``<tenant>.trainer`` /
``<tenant>.sampler``) on the service's group, so tenants take turns on shared devices.
Units already queued when one finishes run in the **same turn** (up to
``units_per_turn``, and not once the policy asks the tenant to yield): the
``optim_step`` the SDK sends right behind a ``forward_backward`` costs no second switch.
Sample units queued together run as **one decode batch** (per weights; see
:mod:`rota_tinker._worker.sampling`): the sampler's ``batch_sample`` takes them all at once.
Each reply carries the unit's timing (turn wait, restore, compute, release; see
:func:`rota_tinker._http.handles.unit_breakdown`). What is parked between turns (by
:mod:`rota_fsdp`):

* full-parameter models: weights, grads and the Adam state;
* LoRA models: only the adapter weights and their Adam state; the base model stays
  resident (it is never trained);
* sampler models: the weights a sampling session samples from (the adapter only, for
  LoRA).

LoRA models (and base-only samplers) do not load their own base when the service shares
bases (the default): they :func:`rota_tinker._worker.holder.attach` to the resident copy of the
base-holder process of their (device, base), which is role ``base`` here (no rota
tenant: the base is resident, never parked, and read-only).

With ``lora_concurrency`` > 1 (:mod:`rota_tinker._worker.shared_turn`) the device units of LoRA models on a shared
base, and samples on a shared base, run in that base's shared LoRA turn instead: several tenants' units at
once in one rota turn; such models are never tracked (they stay on the device).

On CUDA each worker also reports its **working set** to the orchestrator (footprint tag
``working``): the CUDA cache its last turn needed beyond its tracked tensors
(activations, workspaces). With a service ``capacity_bytes`` the orchestrator counts it
when it decides which tenants stay resident, so residents never add up past the device.

Saving weights for the sampler needs no device: it is written from the tracked host
copy (``Tracked.state_dict()``), without a turn, to ``DATA_DIR/TENANT/MODEL/sampler_weights/NAME/``
in the files peft and transformers load (:mod:`rota_tinker._worker.state_files`; directories 0700,
files 0600). Unloading a model
(``unload``) or forgetting a sampler's weights (``forget``) untracks it inside a turn
(a parked model is restored before it is dropped, so that must not happen outside one).

On exit a worker drops every model and its references to a shared base before its
process ends, so a CUDA base holder sees its IPC tensors released (the service stops
tenant workers, waits for them, then the holders).
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from rota import hookimpl
from rota_tinker._worker.common import WorkerSpec
from rota_tinker._worker.loop import Loop

log = logging.getLogger("rota_tinker.worker")


def main(spec: WorkerSpec, conn: Connection) -> None:
    """Worker entry point (the ``spawn`` target)."""
    t0 = time.monotonic()
    logging.basicConfig(level=os.environ.get("ROTA_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s {spec.tenant}.{spec.role} %(levelname)s %(name)s: %(message)s")
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever downloaded: models come from their local snapshots
    if spec.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before CUDA starts: cuBLAS's reproducible mode
    import torch

    import rota

    imported = time.monotonic()
    torch.set_num_threads(spec.torch_threads)
    if spec.deterministic:
        torch.use_deterministic_algorithms(True)
    gpu, working = None, None
    try:
        if spec.role == "base":
            from rota_tinker._worker.holder import BaseHolder

            worker: Any = BaseHolder(spec)
            hello = worker.hello()
        else:
            name = spec.tenant if spec.role == "batch" else f"{spec.tenant}.{spec.role}"
            gpu = rota.connect(group=spec.group, tenant=name, endpoint=spec.endpoint)
            worker = _roles()[spec.role](spec, gpu)
            if worker.device.type == "cuda":
                from rota_torch import WorkingSet

                working = WorkingSet(gpu, worker.device)
                ParkMeter(gpu, worker.device)
            hello = {}
    except Exception as e:  # the service names the cause (e.g. a base model file that does not fit its spec)
        log.error("could not start: %s", traceback.format_exc())
        conn.send(("failed", os.getpid(), f"{type(e).__name__}: {e}"))
        if gpu is not None:
            gpu.close()
        return
    # where the start went (the service reports it): imports, then the worker (CUDA, a base holder's base)
    hello["start"] = {"main_s": t0, "import_s": imported - t0, "setup_s": time.monotonic() - imported}
    conn.send(("ready", os.getpid(), hello))
    try:
        if spec.role == "batch":  # passes over every tenant's queued work (rota_tinker._worker.passes)
            from rota_tinker._worker.passes import BatchLoop

            BatchLoop(worker, gpu, conn, working).run()
        else:
            Loop(worker, gpu, conn, spec.units_per_turn, working).run()
    finally:
        try:  # leave quietly: the orchestrator may already be gone when the service shuts down
            if gpu is not None and gpu.grant is not None:
                gpu.release()
        except Exception as e:
            log.warning("release at exit failed: %s", e)
        worker.close()
        if gpu is not None:
            gpu.close()


def _roles() -> dict[str, type]:
    from rota_tinker._worker.batch import BatchTrainer
    from rota_tinker._worker.roles import Sampler, Trainer

    return {"trainer": Trainer, "sampler": Sampler, "batch": BatchTrainer}


class ParkMeter:
    """NVML's bytes of this worker process just before each park of its tenant (every tracked model).

    A hook wrapper around ``rota_park``: it adds one part, ``process:nvml_before``, after every adapter parked.
    What the park left is read once, by rota_torch's last part (``process:outside_allocator`` + ``reserved``:
    NVML's bytes after it), so the two say what the whole park gave back to the driver.
    """

    def __init__(self, gpu: Any, device: Any) -> None:
        self.gpu, self.device = gpu, device
        gpu.pm.register(self, name=f"rota-tinker-park-meter-{id(self)}")

    @hookimpl(wrapper=True)
    def rota_park(self, tenant: Any, plan: Any) -> Any:
        from rota_torch import process_device_bytes

        before = process_device_bytes(self.device) if tenant is self.gpu else None
        parts = yield
        if before is not None:
            from rota import ParkResult

            parts.append(ParkResult(residue={"process:nvml_before": before}))
        return parts

