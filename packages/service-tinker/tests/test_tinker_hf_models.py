"""Real Hugging Face models (tiny Qwen3 and Llama configs, random weights, a tokenizer trained here) served by their
hub names from a hub cache and a plain model folder, driven by the real tinker SDK: tokenizer offline, LoRA (peft) and
full-parameter tenants, all losses, stop strings, prompt logprobs, save/load state, listing and archives."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker_testlib import KEYS, concurrently, full_training_client, serving_hf_models

from rota_tinker import TinkerService, find_models, search_dirs
from rota_tinker.testing import hf_snapshot, hub_cache_snapshot

TIMEOUT = 180
QWEN = "acme/Qwen3-Tiny"  # in the hub cache (models--acme--Qwen3-Tiny/snapshots/REV)
LLAMA = "acme/Llama-Tiny"  # a plain folder MODEL_DIR/acme/Llama-Tiny, tied embeddings
TEXT = "hello world, stop here. the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("hf")
    cache, model_dir = root / "cache", root / "models"
    hub_cache_snapshot(cache, QWEN, seed=1)
    hf_snapshot(model_dir / "acme" / "Llama-Tiny", arch="llama", seed=2, tie=True)
    (model_dir / "not-a-model").mkdir()
    yield cache, model_dir


@pytest.fixture(scope="module")
def hf_service(dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    with serving_hf_models([str(dirs[1]), str(dirs[0])], str(tmp_path_factory.mktemp("tinker-hf")),
                           "tinker-hf") as svc:
        yield svc


@pytest.fixture(scope="module")
def sc(hf_service: TinkerService) -> Iterator[dict[str, tinker.ServiceClient]]:
    clients = {t: tinker.ServiceClient(base_url=hf_service.url, api_key=k) for t, k in KEYS.items()}
    yield clients


def tokenizer(service: TinkerService, name: str = QWEN) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(service.config.base_models[name].path)


def datum(ids: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64),
                                       "weights": np.ones(len(ids) - 1, np.float32)})


def steps(tc: object, data: list[types.Datum], n: int, lr: float = 1e-2) -> list[float]:
    out = []
    for _ in range(n):
        fb = tc.forward_backward(data, "cross_entropy")  # type: ignore[attr-defined]
        op = tc.optim_step(types.AdamParams(learning_rate=lr))  # type: ignore[attr-defined]
        out.append(fb.result(timeout=TIMEOUT).metrics["loss:sum"])
        op.result(timeout=TIMEOUT)
    return out


def test_models_are_found_by_hub_name_and_listed(dirs: tuple[Path, Path], hf_service: TinkerService,
                                                 sc: dict[str, tinker.ServiceClient]) -> None:
    assert search_dirs([str(dirs[1])], {"HF_HUB_CACHE": str(dirs[0])}) == [str(dirs[1]), str(dirs[0])]
    assert search_dirs([], {"HF_HOME": "/srv/hf"}) == ["/srv/hf/hub"]
    found = find_models(search_dirs([str(dirs[1])], {"HF_HUB_CACHE": str(dirs[0])}))
    assert sorted(found) == [LLAMA, QWEN]
    assert found[QWEN].tokenizer_id == QWEN  # hub cache: the hub name loads from a shared cache
    assert found[LLAMA].tokenizer_id == LLAMA  # plain folder: its hub name too, never the server's path
    caps = tinker.RestClient(base_url=hf_service.url, api_key=KEYS["alice"]).get_server_capabilities().result(
        timeout=TIMEOUT)
    assert {(m.model_name, m.max_context_length) for m in caps.supported_models} == {(QWEN, 128), (LLAMA, 128)}
    with pytest.raises(tinker.NotFoundError) as e:
        sc["alice"].create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result(timeout=TIMEOUT)
    assert "Qwen/Qwen3-8B" in str(e.value) and str(dirs[1]) in str(e.value) and str(dirs[0]) in str(e.value)


def test_sdk_get_tokenizer_loads_offline_on_a_client_sharing_the_cache(dirs: tuple[Path, Path],
                                                                      hf_service: TinkerService) -> None:
    """A user's process (HF_HUB_OFFLINE=1, the service's hub cache): TrainingClient.get_tokenizer() and
    SamplingClient.get_tokenizer() load both models' tokenizers by the hub names get_info gives: the plain-folder
    one from a copy of that folder beside the client (transformers takes ``ORG/NAME`` as a local folder first)."""
    script = (
        "import json, sys, tinker\n"
        "sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])\n"
        "out = {}\n"
        f"for name in ({QWEN!r}, {LLAMA!r}):\n"
        "    tc = sc.create_lora_training_client(base_model=name, rank=2).result(timeout=300)\n"
        f"    out[name] = [tc.get_info().model_data.tokenizer_id, tc.get_tokenizer().encode({TEXT!r})]\n"
        f"sampler = sc.create_sampling_client(base_model={QWEN!r})\n"
        f"out['sampler'] = sampler.get_tokenizer().encode({TEXT!r})\n"
        "print(json.dumps(out))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(dirs[0]), "TINKER_TELEMETRY": "0"}
    env.pop("HF_HOME", None)
    proc = subprocess.run([sys.executable, "-c", script, hf_service.url, KEYS["bob"]], env=env, capture_output=True,
                          text=True, timeout=600, cwd=dirs[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ids = tokenizer(hf_service).encode(TEXT)
    assert out[QWEN] == [QWEN, ids] and out["sampler"] == ids
    assert out[LLAMA] == [LLAMA, tokenizer(hf_service, LLAMA).encode(TEXT)]


def test_vocab_checks_stop_strings_and_prompt_logprobs(sc: dict[str, tinker.ServiceClient],
                                                       hf_service: TinkerService) -> None:
    tc = sc["alice"].create_lora_training_client(base_model=QWEN, rank=4, seed=1).result(timeout=TIMEOUT)
    tok = tokenizer(hf_service)
    vocab = len(tok)
    r = httpx.post(f"{hf_service.url}/api/v1/asample", headers={"X-API-Key": KEYS["alice"]}, timeout=30, json={
        "base_model": QWEN, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, vocab]}]},
        "sampling_params": {}})
    assert r.status_code == 400 and f"vocabulary of {vocab} tokens" in r.json()["detail"]
    with pytest.raises(tinker.BadRequestError, match=f"vocabulary of {vocab} tokens"):
        tc.forward_backward([datum([1, 2, vocab + 5])], "cross_entropy").result(timeout=TIMEOUT)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
    prompt = types.ModelInput.from_ints(tok.encode("hello"))
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=5, stop=[])).result(timeout=TIMEOUT)
    toks = list(free.sequences[0].tokens)
    assert free.sequences[0].stop_reason == "length" and len(toks) == 12
    # two sequences decoded as one batch on the KV cache: each one's logprobs are what a full forward gives
    pair = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8, seed=6, stop=[])).result(timeout=TIMEOUT)
    assert list(pair.sequences[0].tokens) != list(pair.sequences[1].tokens)
    for s in pair.sequences:
        whole = prompt.to_ints() + list(s.tokens)
        full = tc.forward([datum(whole)], "cross_entropy").result(timeout=TIMEOUT).loss_fn_outputs[0]["logprobs"]
        np.testing.assert_allclose(s.logprobs, full.tolist()[-8:], rtol=0, atol=1e-4)
    stop = tok.decode(toks[:5])[-3:]  # a string that the same seeded sample produces by its 5th token
    first = next(i for i in range(1, 13) if stop in tok.decode(toks[:i]))
    got = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=5, stop=stop)).result(timeout=TIMEOUT)
    seq = got.sequences[0]
    assert seq.stop_reason == "stop" and list(seq.tokens) == toks[:first]  # ends with the token completing it
    ids = tok.encode(TEXT)
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result(timeout=TIMEOUT)
    fwd = tc.forward([datum(ids)], "cross_entropy").result(timeout=TIMEOUT)
    assert lps[0] is None
    np.testing.assert_allclose(lps[1:], fwd.loss_fn_outputs[0]["logprobs"].tolist(), rtol=0, atol=1e-5)


def _run(sc: tinker.ServiceClient, mode: str, data: list[types.Datum]) -> list[float]:
    tc = (full_training_client(sc, LLAMA) if mode == "full"
          else sc.create_lora_training_client(base_model=QWEN, rank=4, seed=3).result(timeout=TIMEOUT))
    return steps(tc, data, 4)


def test_lora_and_full_tenants_concurrently_equal_alone(sc: dict[str, tinker.ServiceClient],
                                                        hf_service: TinkerService) -> None:
    data = [datum(tokenizer(hf_service).encode(TEXT))]
    results = concurrently({"bob": lambda: _run(sc["bob"], "full", data),
                            "carol": lambda: _run(sc["carol"], "lora", data)})
    assert results["bob"] == _run(sc["bob"], "full", data)
    assert results["carol"] == _run(sc["carol"], "lora", data)
    assert results["bob"][-1] < results["bob"][0] and results["carol"][-1] < results["carol"][0]
    holder = hf_service.base_holder_info(QWEN, checksum=True)  # LoRA tenants train on the one shared copy...
    assert holder["unchanged"] and holder["bytes"] >= 4 * hf_service.config.base_models[QWEN].params()  # ...untouched
    for tenant in ("bob", "carol"):  # they took turns: each one's state was parked (a failed park would move nothing)
        assert any(u["parked_bytes"] > 0 for u in hf_service.unit_timings() if u["tenant"] == tenant), tenant


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_save_state_resumes_bit_identically_and_archives_load_outside(
        mode: str, sc: dict[str, tinker.ServiceClient], hf_service: TinkerService) -> None:
    """save_state -> create_training_client_from_state_with_optimizer continues exactly like the original; the
    downloaded archive loads with peft (adapter) / transformers (full) and gives the service's logprobs."""

    client = sc["dave"]
    tok = tokenizer(hf_service)
    data = [datum(tok.encode(TEXT))]
    tc = (client.create_lora_training_client(base_model=QWEN, rank=4, seed=9).result(timeout=TIMEOUT)
          if mode == "lora" else full_training_client(client, QWEN))
    steps(tc, data, 2)
    path = tc.save_state(f"ck-{mode}").result(timeout=TIMEOUT).path
    assert path == f"tinker://{tc.model_id}/weights/ck-{mode}"
    ids = tok.encode(TEXT)
    service_lp = tc.forward([datum(ids)], "cross_entropy").result(timeout=TIMEOUT).loss_fn_outputs[0]["logprobs"]
    original = steps(tc, data, 3)
    resumed_tc = client.create_training_client_from_state_with_optimizer(path).result(timeout=TIMEOUT)
    assert resumed_tc.model_id.endswith(":train:" + resumed_tc.model_id.rsplit(":", 1)[1])
    resumed = steps(resumed_tc, data, 1)
    # the sampler's turn parks the resumed model (weights, grads, the loaded Adam state) and restores it after
    sampler = client.create_sampling_client(base_model=QWEN).result(timeout=TIMEOUT)
    sampler.sample(types.ModelInput.from_ints(ids[:4]), 1, types.SamplingParams(max_tokens=2, seed=1)).result(
        timeout=TIMEOUT)
    assert resumed + steps(resumed_tc, data, 2) == original
    parked = [u for u in hf_service.unit_timings() if u["tenant"] == "dave" and u["kind"] == "ForwardBackward"]
    assert max(parked, key=lambda u: u["submitted"])["parked_bytes"] == 0  # nothing since
    assert any(u["parked_bytes"] > 0 for u in parked[-3:])  # the park around the sample moved the loaded state
    weights_only = client.create_training_client_from_state(path).result(timeout=TIMEOUT)
    assert steps(weights_only, data, 3) != original  # a fresh optimizer: not the same steps

    local, files = _archived_logprobs(hf_service, "dave", f"{tc.model_id}/checkpoints/weights/ck-{mode}", QWEN, ids)
    assert "optimizer.pt" in files and ("adapter_config.json" in files) == (mode == "lora")
    np.testing.assert_allclose(local, np.asarray(service_lp.tolist()), rtol=0, atol=1e-5)


def _archived_logprobs(service: TinkerService, tenant: str, checkpoint: str, base: str,
                       ids: list[int]) -> tuple[np.ndarray, set[str]]:
    """Download ``RUN/checkpoints/KIND/NAME``'s archive and load it outside rota (adapter files with peft on the
    base, full weights and tokenizer with from_pretrained): the logprobs it gives ``ids``, and its files."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = httpx.get(f"{service.url}/api/v1/training_runs/{checkpoint}/archive", headers={"X-API-Key": KEYS[tenant]},
                  timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar", r.text[:300]
    out = Path(service.config.data_dir).parent / f"download-{checkpoint.replace('/', '-')}"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(out, filter="data")
    folder = out / checkpoint.rsplit("/", 1)[1]
    files = set(os.listdir(folder))
    if "adapter_config.json" in files:
        assert "adapter_model.safetensors" in files
        model = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(service.config.base_models[base].path), str(folder))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder))
        assert AutoTokenizer.from_pretrained(str(folder)).encode(TEXT) == ids
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0].float()
    local = torch.gather(torch.log_softmax(logits, -1), 1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return local.numpy(), files


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_sampler_weights_download_as_an_archive_that_loads_outside(
        mode: str, sc: dict[str, tinker.ServiceClient], hf_service: TinkerService) -> None:
    """save_weights_for_sampler's weights, written from the trainer's parked host copy, download as the same kind of
    archive as a training checkpoint (no optimizer state): peft (LoRA on Qwen3) / from_pretrained (full Llama, tied
    embeddings) load it and give the logprobs the service's sampler gives on those weights."""
    client = sc["carol"]
    base = QWEN if mode == "lora" else LLAMA
    ids = tokenizer(hf_service, base).encode(TEXT)
    tc = (client.create_lora_training_client(base_model=QWEN, rank=4, seed=2).result(timeout=TIMEOUT)
          if mode == "lora" else full_training_client(client, LLAMA))
    steps(tc, [datum(ids)], 2)
    # another rota tenant's turn (carol's sampler) parks the trainer's state before it is saved for the sampler
    client.create_sampling_client(base_model=base).result(timeout=TIMEOUT).sample(
        types.ModelInput.from_ints(ids[:4]), 1, types.SamplingParams(max_tokens=2, seed=1)).result(timeout=TIMEOUT)
    path = tc.save_weights_for_sampler(f"s-{mode}").result(timeout=TIMEOUT).path
    sampler = client.create_sampling_client(model_path=path).result(timeout=TIMEOUT)
    service_lp = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result(timeout=TIMEOUT)
    local, files = _archived_logprobs(hf_service, "carol", f"{tc.model_id}/checkpoints/sampler_weights/s-{mode}",
                                      base, ids)
    assert "optimizer.pt" not in files and ("adapter_config.json" in files) == (mode == "lora")
    np.testing.assert_allclose(local, np.asarray(service_lp[1:], np.float64), rtol=0, atol=1e-5)
    trained = tc.forward([datum(ids)], "cross_entropy").result(timeout=TIMEOUT).loss_fn_outputs[0]["logprobs"]
    np.testing.assert_allclose(local, np.asarray(trained.tolist()), rtol=0, atol=1e-5)  # the trained weights
    fwd = [u for u in hf_service.unit_timings() if u["tenant"] == "carol" and u["kind"] == "ForwardBackward"]
    assert max(fwd, key=lambda u: u["submitted"])["parked_bytes"] > 0  # parked when it was saved (no turn)


def test_rl_losses_follow_their_formulas(sc: dict[str, tinker.ServiceClient], hf_service: TinkerService) -> None:
    """importance_sampling, ppo, cispo, gspo and dro: the loss the service reports is the docs' formula of its
    logprobs (gspo: every token carries the sequence ratio, the geometric mean over ``sequence_ratio_mask``)."""
    ids = tokenizer(hf_service).encode(TEXT)
    tc = sc["alice"].create_lora_training_client(base_model=QWEN, rank=2, seed=4).result(timeout=TIMEOUT)
    n = len(ids) - 1
    rng = np.random.default_rng(0)
    old = rng.normal(-5.0, 0.5, n).astype(np.float32)
    adv = rng.normal(0.0, 1.0, n).astype(np.float32)
    rl = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64), "logprobs": old,
                                     "advantages": adv})
    lp = np.asarray(tc.forward([datum(ids)], "cross_entropy").result(timeout=TIMEOUT)
                    .loss_fn_outputs[0]["logprobs"].tolist(), np.float64)
    ratio = np.exp(lp - old)
    expect = {"importance_sampling": (-(ratio * adv).sum(), None),
              "ppo": (-np.minimum(ratio * adv, np.clip(ratio, 0.9, 1.1) * adv).sum(),
                      {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
              "cispo": (-(np.clip(ratio, 0.8, 1.2) * lp * adv).sum(), None),
              "dro": (-(lp * adv - 0.5 * 0.1 * (lp - old) ** 2).sum(), {"beta": 0.1})}
    for loss_fn, (value, config) in expect.items():
        out = tc.forward([rl], loss_fn, loss_fn_config=config).result(timeout=TIMEOUT)
        assert out.metrics["loss:sum"] == pytest.approx(value, rel=1e-4), loss_fn
    mask = (np.arange(n) >= n // 2).astype(np.float32)  # the sequence ratio over the second half only
    for seq_mask, in_ratio in ((None, np.ones(n, bool)), (mask, mask != 0)):
        seq = np.exp((lp - old)[in_ratio].mean())
        gspo = types.Datum(model_input=rl.model_input,
                           loss_fn_inputs={**rl.loss_fn_inputs, **({} if seq_mask is None else
                                                                   {"sequence_ratio_mask": seq_mask})})
        out = tc.forward([gspo], "gspo", loss_fn_config={"clip_low_threshold": 0.5, "clip_high_threshold": 1.5})
        value = -np.minimum(seq * adv, np.clip(seq, 0.5, 1.5) * adv).sum()
        assert out.result(timeout=TIMEOUT).metrics["loss:sum"] == pytest.approx(value, rel=1e-4)
    with pytest.raises(tinker.BadRequestError, match="loss_fn_config key 'beta'"):
        tc.forward([rl], "ppo", loss_fn_config={"beta": 1.0}).result(timeout=TIMEOUT)


def test_runs_checkpoints_and_sessions_are_listed(sc: dict[str, tinker.ServiceClient],
                                                  hf_service: TinkerService) -> None:
    client = sc["carol"]
    tc = client.create_lora_training_client(base_model=LLAMA, rank=2, seed=1).result(timeout=TIMEOUT)
    tc.save_state("listed").result(timeout=TIMEOUT)
    tc.save_weights_for_sampler("listed-sampler").result(timeout=TIMEOUT)
    rest = tinker.RestClient(base_url=hf_service.url, api_key=KEYS["carol"])
    runs = rest.list_training_runs(limit=100).result(timeout=TIMEOUT)
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    assert all(r.model_owner == "carol" for r in runs.training_runs)
    run = rest.get_training_run(tc.model_id).result(timeout=TIMEOUT)
    assert run.base_model == LLAMA and run.is_lora and run.lora_rank == 2
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path.endswith("/weights/listed")
    cks = rest.list_checkpoints(tc.model_id).result(timeout=TIMEOUT).checkpoints
    assert sorted((c.checkpoint_type, c.checkpoint_id) for c in cks) == [
        ("sampler", "sampler_weights/listed-sampler"), ("training", "weights/listed")]
    assert client.holder.get_session_id() in rest.list_sessions().result(timeout=TIMEOUT).sessions
    rest.delete_checkpoint_from_tinker_path(f"tinker://{tc.model_id}/weights/listed").result(timeout=TIMEOUT)
    assert [c.checkpoint_type for c in rest.list_checkpoints(tc.model_id).result(timeout=TIMEOUT).checkpoints] == [
        "sampler"]


def test_unsupported_features_answer_400_naming_them(hf_service: TinkerService) -> None:
    """A route or field the service lacks is a 400 naming it, at once: the SDK retries 408, 409, 429 and every 5xx
    for minutes whatever x-should-retry says, a 400 it raises."""
    key = {"X-API-Key": KEYS["alice"]}

    def refused(r: httpx.Response, what: str) -> None:
        assert r.status_code == 400 and what in r.json()["detail"], r.text
        assert "not implemented" in r.json()["detail"] or "only" in r.json()["detail"], r.text

    refused(httpx.post(f"{hf_service.url}/api/v1/cancel_future", headers=key, json={}, timeout=30), "cancel_future")
    refused(httpx.post(f"{hf_service.url}/api/v1/asample", headers=key, timeout=30, json={
        "base_model": QWEN, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {}, "record_stability_info": True}), "record_stability_info")
    refused(httpx.post(f"{hf_service.url}/api/v1/asample", headers=key, timeout=30, json={
        "base_model": QWEN, "prompt": {"chunks": [{"type": "image", "data": "", "format": "png"}]},
        "sampling_params": {}}), "'image' chunk")
    r = httpx.post(f"{hf_service.url}/api/v1/optim_step", headers=key, timeout=30, json={
        "model_id": "x", "optimizer_params": {"type": "sgd"}})
    assert r.status_code in (403, 404)  # the model is checked first; with a real one:
    tc = tinker.ServiceClient(base_url=hf_service.url, api_key=KEYS["alice"]).create_lora_training_client(
        base_model=QWEN, rank=2).result(timeout=TIMEOUT)
    refused(httpx.post(f"{hf_service.url}/api/v1/optim_step", headers=key, timeout=30, json={
        "model_id": tc.model_id, "optimizer_params": {"type": "sgd"}}), "optimizer_params")
    ids = tokenizer(hf_service).encode(TEXT)
    rl = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": np.asarray(ids[1:], np.int64), "logprobs": np.zeros(len(ids) - 1, np.float32),
        "advantages": np.ones(len(ids) - 1, np.float32)})
    with pytest.raises(tinker.BadRequestError, match="has no provenance"):  # stable_reinforce needs recorded samples
        tc.forward([rl], "stable_reinforce").result(timeout=30)  # the SDK's own client raises, it does not retry
    assert np.isfinite(tc.forward([datum(ids)], "cross_entropy").result(timeout=TIMEOUT).metrics["loss:sum"])


@pytest.mark.parametrize("arch,tie,weights", [("qwen3", False, True), ("llama", True, True), ("qwen3", True, False),
                                              ("llama", False, False), ("qwen2", False, True), ("qwen2", True, False),
                                              ("gemma", True, True), ("gemma3_text", True, False)])
def test_state_estimates_count_the_real_parameters(tmp_path: Path, arch: str, tie: bool, weights: bool) -> None:
    """Qwen3, Llama, Qwen2.5 (qwen2) and Gemma families build and train; the byte quota's estimate counts exactly
    what the workers build: from safetensors headers, or (random init, no weights in the folder) on a meta model;
    LoRA parameters as peft makes them."""
    from rota_tinker._worker.models import adapters_of, add_lora, build_base, token_logprobs

    spec = find_models([str(hf_snapshot(tmp_path / "m", arch=arch, tie=tie, weights=weights).parent)])["m"]
    assert spec.has_weights is weights
    model = build_base(spec, torch.device("cpu"))
    assert spec.params() == sum(p.numel() for p in model.parameters())
    for targets in ({"attn": True, "mlp": True, "unembed": True}, {"attn": False, "mlp": True, "unembed": False}):
        peft_model = add_lora(build_base(spec, torch.device("cpu")), 3, 0, targets)
        adapters = adapters_of(peft_model)
        assert spec.lora_params(3, targets) == sum(p.numel() for p in adapters.parameters())
    ids = torch.arange(1, 12)
    loss = -token_logprobs(peft_model, ids[:-1], ids[1:]).sum()
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in adapters.named_parameters() if "lora_B" in n}  # B starts at 0: A gets none yet
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def _sl_loop(service: TinkerService, cache: Path, log_path: Path, data: Path, *extra: str) -> list[dict]:
    """Run the cookbook-style ``sl_loop.py`` as a user would (its own process, the SDK, offline hub cache)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "TINKER_API_KEY": KEYS["bob"],
           "TINKER_TELEMETRY": "0"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sl_loop.py")), f"base_url={service.url}",
                           f"model_name={QWEN}", f"log_path={log_path}", f"data={data}", *extra], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_cookbook_style_sl_loop_trains_checkpoints_and_resumes(dirs: tuple[Path, Path], hf_service: TinkerService,
                                                               tmp_path: Path) -> None:
    """The cookbook's sl_loop shape, unchanged but for base_url and model_name: it trains (mean NLL falls), saves
    state and sampler weights, and a run stopped after 3 batches resumes from its last state exactly as the
    uninterrupted run went on."""
    data = tmp_path / "conversations.jsonl"
    talks = [[{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello, how can i help?"}],
             [{"role": "user", "content": "say it"}, {"role": "assistant", "content": "the quick brown fox."}]]
    data.write_text("".join(json.dumps({"messages": talks[i % 2]}) + "\n" for i in range(12)))
    whole = _sl_loop(hf_service, dirs[0], tmp_path / "whole", data)
    assert [r["step"] for r in whole] == list(range(6))
    assert whole[-1]["train_mean_nll"] < whole[0]["train_mean_nll"]
    saved = [json.loads(line) for line in (tmp_path / "whole" / "checkpoints.jsonl").read_text().splitlines()]
    assert [r["name"] for r in saved] == ["000002", "000004", "final"]
    assert saved[-1]["sampler_path"].endswith("/sampler_weights/final")
    first = _sl_loop(hf_service, dirs[0], tmp_path / "cut", data, "stop_after=3")
    rest = _sl_loop(hf_service, dirs[0], tmp_path / "cut", data)
    assert [r["step"] for r in first] == [0, 1, 2] and [r["step"] for r in rest] == [2, 3, 4, 5]
    assert [r["train_mean_nll"] for r in first + rest[1:]] == [r["train_mean_nll"] for r in whole]


def test_readme_quick_start_runs(dirs: tuple[Path, Path], hf_service: TinkerService, tmp_path: Path) -> None:
    """The README's quick start, in a user's process, with only its URL and model name replaced."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "quick_start.py"
    script.write_text(code.replace("http://127.0.0.1:8000", hf_service.url).replace("Qwen/Qwen3-0.6B", QWEN))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(dirs[0]), "TINKER_API_KEY": KEYS["alice"],
           "TINKER_TELEMETRY": "0"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[1]) for line in proc.stdout.splitlines()[:10]]
    assert len(losses) == 10 and losses[-1] < losses[0]


def test_forward_backward_custom_trains_like_its_builtin_twin(sc: dict[str, tinker.ServiceClient],
                                                              hf_service: TinkerService) -> None:
    """The SDK's client-side custom loss (a forward, then cross_entropy with weights -dC/dlogprobs): a custom
    negative log-likelihood moves a model exactly as far as cross_entropy moves its twin (same LoRA seed)."""
    ids = tokenizer(hf_service).encode(TEXT)
    data = [datum(ids)]
    twins = [sc["carol"].create_lora_training_client(base_model=QWEN, rank=2, seed=21).result(timeout=TIMEOUT)
             for _ in range(2)]

    def nll(batch: list, logprobs: list) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"nll": float(loss)}

    custom = twins[0].forward_backward_custom(data, nll).result(timeout=TIMEOUT)
    builtin = twins[1].forward_backward(data, "cross_entropy").result(timeout=TIMEOUT)
    assert custom.metrics["nll"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-6)
    for tc in twins:
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT)
    after = [np.asarray(tc.forward(data, "cross_entropy").result(timeout=TIMEOUT).loss_fn_outputs[0]["logprobs"]
                        .tolist()) for tc in twins]
    np.testing.assert_allclose(after[0], after[1], rtol=0, atol=1e-6)
    assert after[0].sum() > -builtin.metrics["loss:sum"]  # and it did learn


def test_large_requests_run_in_micro_batches_with_the_same_results(sc: dict[str, tinker.ServiceClient],
                                                                   hf_service: TinkerService) -> None:
    """70 sequences of 120 tokens (past MICRO_BATCH_TOKENS in one forward): each datum's logprobs and the summed loss
    are what the sequences give one at a time."""
    from rota_tinker._worker.common import MICRO_BATCH_TOKENS

    rng = np.random.default_rng(3)
    data = [datum(rng.integers(0, 300, size=121).tolist()) for _ in range(70)]
    assert 70 * 120 > MICRO_BATCH_TOKENS
    tc = sc["dave"].create_lora_training_client(base_model=QWEN, rank=2, seed=8).result(timeout=TIMEOUT)
    together = tc.forward(data, "cross_entropy").result(timeout=TIMEOUT)
    for i in (0, 33, 68, 69):
        alone = tc.forward([data[i]], "cross_entropy").result(timeout=TIMEOUT)
        np.testing.assert_allclose(together.loss_fn_outputs[i]["logprobs"].tolist(),
                                   alone.loss_fn_outputs[0]["logprobs"].tolist(), rtol=0, atol=1e-5)
    total = sum(-np.sum(out["logprobs"].tolist()) for out in together.loss_fn_outputs)
    assert together.metrics["loss:sum"] == pytest.approx(total, rel=1e-6)
