"""rota_vllm on a real GPU: an in-process ``vllm.LLM`` tracked with ``rota_vllm.track`` takes turns with a
rota_fsdp trainer of another job on one device, through an orchestrator that parks at every switch.

Both are processes of their own (this file run as a script: ``engine`` and ``trainer``) on a Qwen3-0.6B-shaped
Hugging Face snapshot built here (random bf16 weights, ``save_pretrained``; vLLM loads the safetensors files).
The engine holds 60% of the device while awake, and in each of its turns the trainer fills 55% of the device
with a tensor of its own: that fits only if the engine's park really freed its memory. Checked:

* after every park, NVML of the engine's process is back to its CUDA context plus ``RESIDUE_MAX``, and the
  trainer's after each of its parks to its context plus ``TRAINER_RESIDUE_MAX`` (a park frees the device);
* ``backup="rota"`` (OFFLOAD, weights in rota's pinned pool, level-2 sleep): greedy tokens after every restore
  equal those before the first park; a weight push (``update_weights``, the embedding scaled) changes them, and
  the pushed weights are what later parks keep;
* ``mode="discard"``: nothing kept; after each restore the snapshot's weights are pushed again and the tokens
  equal those before the first park (the engine as it was loaded).

Needs vLLM (0.26.0 on the H200 host: bench/stage_wheels.py) importable; skipped otherwise, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

GB = 1 << 30
MIB = 1 << 20
RESIDUE_MAX = 256 * MIB  # NVML bytes a parked engine may hold beyond its CUDA context
TRAINER_RESIDUE_MAX = 512 * MIB  # and the parked trainer (cuBLAS's and the allocator's small pool's, at most)
TURNS = 4
ENGINE_SHARE = 0.6  # of the device, for vLLM (weights + KV cache)
TRAINER_FILL = 0.55  # of the device, filled by the trainer in each of its turns: fits only beside a parked engine
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)


def engine(snapshot: str, how: str, out: str) -> None:
    """The engine's process: generate in each turn, check tokens, record NVML after each park."""
    import torch
    from park_probe import device_processes, nvml_after_parks, wait_for_count
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    import rota
    import rota_vllm
    from rota_torch import process_device_bytes

    torch.zeros(1, device="cuda:0")
    context = process_device_bytes("cuda:0")
    llm = LLM(model=snapshot, enable_sleep_mode=True, skip_tokenizer_init=True, seed=0, dtype="bfloat16",
              gpu_memory_utilization=ENGINE_SHARE, enforce_eager=True,
              enable_prefix_caching=False)  # a cached prefix takes another kernel path: random weights' near-ties flip
    params = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 164 + 7 * i))} for i in range(8)]

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    weights = {}
    for f in sorted(Path(snapshot).glob("*.safetensors")):
        weights |= load_file(str(f))
    gpu = rota.connect()
    after_park = nvml_after_parks(gpu)  # what the parked engine still holds
    tracked = (rota_vllm.track(gpu, llm, mode="discard") if how == "discard" else rota_vllm.track(gpu, llm))
    want, pushed, equal, changed = None, None, [], None
    for turn in range(TURNS):
        with gpu.turn():
            if how == "discard" and turn:
                tracked.update_weights(weights.items())  # the engine as it was loaded
            got = generate()
            if want is None:
                want = got
                awake = (process_device_bytes("cuda:0"), tracked.rota_footprint(gpu)["engine"])  # NVML, footprint
            if how == "offload" and turn == 1:  # an RL weight sync: the next rollouts use it, parks keep it
                emb = next(k for k in weights if k.endswith("embed_tokens.weight"))
                tracked.update_weights([(emb, weights[emb] * 1.5)])
                pushed = generate()
                changed = pushed != want
            equal.append(got == (pushed if pushed is not None and turn > 1 else want))
        Path(out).with_suffix(".ready").touch()  # the trainer starts after the engine's first turn
        if turn + 1 < TURNS:  # the trainer takes its turn (this engine parked) before this engine's next one:
            # so every engine turn after the first follows a park (without waiting, an engine that is quick could
            # end its turns before the trainer asked for one)
            wait_for_count(Path(out).with_suffix(".trainer"), turn + 1, "the trainer")
            print(f"engine {os.getpid()} before turn {turn + 1}: device bytes by pid {device_processes()}",
                  file=sys.stderr, flush=True)
    Path(out).write_text(json.dumps({"context": context, "after_park": after_park, "equal": equal,
                                     "push_changed_tokens": changed, "parks": len(gpu.stats.parks),
                                     "restores": len(gpu.stats.restores),
                                     "failures": [str(f) for f in gpu.stats.failures],
                                     "park_s": [p.seconds for p in gpu.stats.parks],
                                     "restore_s": [r.seconds for r in gpu.stats.restores],
                                     "stash_bytes": tracked.stash_bytes, "awake_nvml": awake[0],
                                     "awake_footprint": awake[1]}, default=str))
    tracked.untrack()
    gpu.close()


def trainer(out: str, ready: str) -> None:
    """The other job: a rota_fsdp model + AdamW; in each turn it also fills TRAINER_FILL of the device.

    It starts once the engine has had its first turn (``ready`` exists): vLLM's start-up profiling wants the
    device to itself, and an engine that is not yet tracked cannot be parked."""
    deadline = time.monotonic() + 300
    while not Path(ready).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"the engine never finished its first turn ({ready} missing after 300 s)")
        time.sleep(0.2)
    import torch
    from park_probe import device_processes, fill_fits, nvml_after_parks, write_count

    import rota
    import rota_fsdp
    from rota_torch import process_device_bytes

    torch.zeros(1, device="cuda:0")
    context = process_device_bytes("cuda:0")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(16)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gpu = rota.connect()
    after_park = nvml_after_parks(gpu)  # a park must free the trainer's device memory too, not only the engine's
    rota_fsdp.track(gpu, model, opt)
    filled, losses = [], []
    total = torch.cuda.get_device_properties(0).total_memory
    for _ in range(TURNS):
        time.sleep(0.3)  # off the device: the engine's turn
        with gpu.turn():
            loss = model(torch.randn(64, 4096, device="cuda")).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            filled.append(fill_fits(int(total * TRAINER_FILL)))
            torch.cuda.empty_cache()
        segments = sorted(((s["total_size"], s["allocated_size"]) for s in torch.cuda.memory_snapshot()), reverse=True)
        print(f"trainer {os.getpid()} after turn {len(filled)} (filled: {filled[-1]}): reserved "
              f"{torch.cuda.memory_reserved()} B, allocated {torch.cuda.memory_allocated()} B, largest segments "
              f"(bytes, of them live) {segments[:4]}, PYTORCH_CUDA_ALLOC_CONF "
              f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}, device "
              f"bytes by pid {device_processes()}", file=sys.stderr, flush=True)
        write_count(Path(ready).with_suffix(".trainer"), len(filled))  # the engine waits for it
    Path(out).write_text(json.dumps({"filled": filled, "losses": losses, "parks": len(gpu.stats.parks),
                                     "context": context, "after_park": after_park,
                                     "failures": [str(f) for f in gpu.stats.failures]}, default=str))
    gpu.close()


if __name__ == "__main__":
    engine(*sys.argv[2:5]) if sys.argv[1] == "engine" else trainer(sys.argv[2], sys.argv[3])
    sys.exit(0)

import pytest  # noqa: E402  (the test side; the children above need none of it)

pytestmark = pytest.mark.engines  # the tier's engines part (ROTA_TIER_PART=engines bash bench/cuda_tier.sh)

pytest.importorskip("vllm", reason="vllm is not importable here: stage vllm 0.26.0 on the GPU machine with "
                                   "bench/stage_wheels.py (see the README), then run the tier")


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("qwen3-0.6b")
    torch.manual_seed(0)
    cfg = Qwen3Config(**SHAPE, max_position_embeddings=4096, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("how", ["offload", "discard"])
def test_a_vllm_engine_and_a_trainer_take_turns_on_one_gpu(tmp_path: Path, snapshot: Path, how: str,
                                                           record) -> None:
    env = os.environ | {"ROTA_GROUP": f"vllm-{how}", "XDG_RUNTIME_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1",
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    os.chmod(tmp_path, 0o700)
    eng_out, tr_out = tmp_path / "engine.json", tmp_path / "trainer.json"
    t0 = time.monotonic()
    eng = subprocess.Popen([sys.executable, __file__, "engine", str(snapshot), how, str(eng_out)],
                           env=env | {"ROTA_TENANT": "engine", "ROTA_RESIDUE_MAX_BYTES": "0"})  # NVML, read per park
    # the trainer keeps the default limit: a tensor of its own left alive across a park faults that park
    tr = subprocess.Popen([sys.executable, __file__, "trainer", str(tr_out), str(eng_out.with_suffix(".ready"))],
                          env=env | {"ROTA_TENANT": "trainer"})
    assert eng.wait(600) == 0 and tr.wait(120) == 0, f"engine exited {eng.returncode}, trainer {tr.returncode}"
    e, t = json.loads(eng_out.read_text()), json.loads(tr_out.read_text())
    residue = [b - e["context"] for b in e["after_park"]]
    record(how=how, seconds=time.monotonic() - t0, engine_parks=e["parks"], engine_restores=e["restores"],
           park_s=e["park_s"], restore_s=e["restore_s"], stash_bytes=e["stash_bytes"],
           residue_after_park_mib=[r // MIB for r in residue], tokens_equal=e["equal"],
           push_changed_tokens=e["push_changed_tokens"], trainer_filled=t["filled"], failures=e["failures"],
           trainer_residue_after_park_mib=[(b - t["context"]) // MIB for b in t["after_park"]],
           awake_above_context_mib=(e["awake_nvml"] - e["context"]) // MIB,
           awake_footprint_mib=e["awake_footprint"] // MIB)
    assert not e["failures"] and not t["failures"], (e["failures"], t["failures"])
    assert e["parks"] >= 2 and e["restores"] >= 2, e
    assert residue and max(residue) <= RESIDUE_MAX, f"NVML after parks minus the context: {residue}"
    assert all(e["equal"]), e["equal"]
    # the footprint the engine reports awake (ENGINE_SHARE of the device and what it holds outside it) covers what
    # its process really holds above its context (1,089 MiB beyond the share alone on the H100 at 47ebe11)
    assert e["awake_nvml"] - e["context"] <= e["awake_footprint"], (e["awake_nvml"], e["context"], e["awake_footprint"])
    trainer_residue = [b - t["context"] for b in t["after_park"]]
    assert trainer_residue and max(trainer_residue) <= TRAINER_RESIDUE_MAX, \
        f"the trainer's NVML after its parks minus its context: {[r // MIB for r in trainer_residue]} MiB"
    assert all(t["filled"]), f"the trainer could not fill {TRAINER_FILL:.0%} of the device: {t['filled']}"
    if how == "offload":
        assert e["push_changed_tokens"], "the weight push did not change the greedy tokens"
        assert e["stash_bytes"] > 1 * GB  # Qwen3-0.6B's weights in bf16
