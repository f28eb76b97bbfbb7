"""rota_trl on a real GPU: two TRL GRPO jobs with vLLM colocated (``use_vllm=True, vllm_mode="colocate"``) take
turns on one device through an orchestrator that parks at every switch (no capacity: ``--capacity 0``).

Each job is its own process (this file run as a script), a GRPOTrainer of a Qwen3-shaped Hugging Face
snapshot (random bf16 weights, a local tokenizer, saved with ``save_pretrained`` and loaded by TRL from its
path), a Python reward, and the one line ``trainer.add_callback(rota_trl.RotaCallback(trainer))``. TRL
sleeps its engine at level 2 after every generation (``vllm_enable_sleep_mode=True``); a park checks that
sleep, empties torch's cache and parks the model and its AdamW state. Checked: each job's losses, rewards and
grad norms step for step equal the same job run alone (deterministic torch kernels, cuBLAS's reproducible
workspace), both jobs were parked and
restored, and NVML after every park is back to the process's bytes before it built anything plus
``RESIDUE_MAX`` (the CUDA context, vLLM's and NCCL's own). Recorded: NVML after each park, the makespan of
the two jobs time-sliced vs one after the other.

Needs TRL (``trl>=1.10,<1.17``), datasets, pyarrow and vLLM (0.26.0 on the H200 host) importable, and
rota-adapter-trl installed; skipped otherwise, saying which is missing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

GB = 1 << 30
RESIDUE_MAX = 1 * GB  # NVML bytes a parked job may hold beyond its context before it built anything
STEPS = 4
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(snapshot: str, seed: int, rota_on: bool, out: str) -> None:
    """One GRPO job (the child process): train, write what the test compares to ``out`` (JSON)."""
    import hashlib

    import torch
    from datasets import Dataset
    from park_probe import nvml_after_parks
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import rota
    import rota_trl
    from rota_torch import process_device_bytes

    torch.zeros(1, device="cuda:0")  # the CUDA context
    context = process_device_bytes("cuda:0")  # this process before it built anything
    tok = AutoTokenizer.from_pretrained(snapshot, local_files_only=True)
    data = Dataset.from_dict({"prompt": ["the quick brown fox", "hello world", "a tiny model", "user: hi"] * 8})

    def reward(completions: list[str], **kwargs: object) -> list[float]:
        return [sum(ch in "aeiou" for ch in c) / max(1, len(c)) for c in completions]

    args = GRPOConfig(output_dir=os.path.join(os.path.dirname(out), f"out-{seed}-{rota_on}"), max_steps=STEPS,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=16, logging_steps=1,
                      report_to=[], save_strategy="no", seed=seed, bf16=True, learning_rate=1e-4,
                      disable_tqdm=True, use_vllm=True, vllm_mode="colocate",
                      vllm_enable_sleep_mode=True, vllm_gpu_memory_utilization=0.2, vllm_max_model_length=128)
    trainer = GRPOTrainer(model=snapshot, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    # deterministic kernels where torch has them (the embedding's backward, cuBLAS), warnings elsewhere:
    # transformers' full_determinism would refuse vLLM's sampling ops that have no deterministic version. Only
    # once the trainer (and its colocated vLLM) is built: the flag also puts Inductor in its deterministic mode,
    # which refuses the combo-kernel benchmarking of vLLM's torch.compile at start-up (H200, vLLM 0.26).
    torch.use_deterministic_algorithms(True, warn_only=True)
    after_park: list[int | None] = []
    gpu = None

    class StartTogether(TrainerCallback):  # the test's, not rota's
        """Training starts once every job has built its trainer and vLLM. Why: building vLLM takes tens of
        seconds and four steps of this model a second or two, so the job whose engine came up first finished
        before the other asked for a turn, and nothing was parked (H200, 4a4fd4f)."""

        def on_train_begin(self, args: object, state: object, control: object, **kwargs: object) -> None:
            mark = Path(out).with_suffix(".started")
            mark.touch()
            deadline = time.monotonic() + 300
            while len(list(mark.parent.glob("*.started"))) < int(os.environ["ROTA_TEST_JOBS"]):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the other jobs did not start training within 300 s ({mark.parent})")
                time.sleep(0.1)
    if rota_on:
        gpu = rota.connect()
        after_park = nvml_after_parks(gpu)  # what the parked job still holds
        trainer.add_callback(StartTogether())
        trainer.add_callback(rota_trl.RotaCallback(trainer, gpu=gpu))
    t0 = time.monotonic()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    digest = hashlib.sha256()
    for _, p in sorted(trainer.model.named_parameters()):
        digest.update(p.detach().float().cpu().numpy().tobytes())
    result = {"loss": [h["loss"] for h in logs], "reward": [h.get("reward") for h in logs],
              "grad_norm": [h.get("grad_norm") for h in logs], "weights": digest.hexdigest(),
              "seconds": time.monotonic() - t0, "context": context, "after_park": after_park}
    if gpu is not None:
        result |= {"parks": len(gpu.stats.parks), "restores": len(gpu.stats.restores)}
        gpu.close()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    job(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "rota", sys.argv[4])
    sys.exit(0)

import pytest  # noqa: E402  (the test side; the child above needs none of it)

pytestmark = pytest.mark.engines  # the tier's engines part (ROTA_TIER_PART=engines bash bench/cuda_tier.sh)

for _module in ("trl", "datasets", "pyarrow", "vllm", "rota_trl"):
    pytest.importorskip(_module, reason=f"{_module} is not importable here: the TRL CUDA test needs TRL, datasets, "
                                        "pyarrow, vLLM and rota-adapter-trl installed (see its docstring)")


def _run(env: dict[str, str], snapshot: Path, seed: int, mode: str, out: Path) -> subprocess.Popen:
    env = env | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port()), "ROTA_TENANT": f"grpo-{seed}", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return subprocess.Popen([sys.executable, __file__, str(snapshot), str(seed), mode, str(out)], env=env)


def _wait(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        assert p.wait(max(1.0, deadline - time.monotonic())) == 0, f"job {p.args[3:5]} exited with {p.returncode}"


def test_two_grpo_jobs_with_colocated_vllm_time_slice_one_gpu(tmp_path: Path, record) -> None:
    from rota.orchestrator import OrchestratorConfig
    from rota.testing import child_environment, running_orchestrator
    from rota_tinker.testing import hf_snapshot

    snapshot = hf_snapshot(tmp_path / "qwen3", "qwen3", dtype="bfloat16", **SHAPE)
    env = child_environment(tmp_path / "runtime") | {"HF_HUB_OFFLINE": "1"}
    seeds = (1, 2)
    t0 = time.monotonic()
    for seed in seeds:  # serial: one after the other, no rota
        _wait([_run(env, snapshot, seed, "alone", tmp_path / f"alone-{seed}.json")], 400)
    serial = time.monotonic() - t0
    with running_orchestrator(OrchestratorConfig(ttl_s=30.0, park_timeout_s=120.0)) as (endpoint, _):
        t0 = time.monotonic()
        shared_env = env | {"ROTA_ORCHESTRATOR": endpoint, "ROTA_TEST_JOBS": str(len(seeds))}
        _wait([_run(shared_env, snapshot, seed, "rota", tmp_path / f"rota-{seed}.json")
               for seed in seeds], 400)
        sliced = time.monotonic() - t0
    alone = {s: json.loads((tmp_path / f"alone-{s}.json").read_text()) for s in seeds}
    shared = {s: json.loads((tmp_path / f"rota-{s}.json").read_text()) for s in seeds}
    record(serial_s=round(serial, 1), time_sliced_s=round(sliced, 1), makespan_ratio=round(sliced / serial, 3),
           **{f"job{s}_nvml_after_park_mib": [None if b is None else b >> 20 for b in shared[s]["after_park"]]
              for s in seeds},
           **{f"job{s}_context_mib": (shared[s]["context"] or 0) >> 20 for s in seeds},
           **{f"job{s}_parks": shared[s]["parks"] for s in seeds})
    for s in seeds:
        for key in ("loss", "reward", "grad_norm", "weights"):
            assert shared[s][key] == alone[s][key], f"job {s}: {key} time-sliced {shared[s][key]} != alone " \
                                                    f"{alone[s][key]}"
        assert shared[s]["parks"] >= 1 and shared[s]["restores"] >= 1, shared[s]
        left = [b - shared[s]["context"] for b in shared[s]["after_park"] if b is not None]
        assert left and max(left) <= RESIDUE_MAX, f"job {s}: NVML after parks minus its context: " \
                                                  f"{[x >> 20 for x in left]} MiB"
