"""bench/tinker_density.py on the CPU (a tiny Qwen3 shape): its peft reference runs first, in the same run, and is
the yardstick of density and think time; every point has tokens/s and MFU (null on CPU, with the reason)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "tinker_density.py")


def _reference_module():
    spec = importlib.util.spec_from_file_location("peft_reference", os.path.join(ROOT, "bench", "peft_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_density_is_measured_against_the_peft_reference(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--model", "qwen3-tiny", "--dtype", "float32",
                           "--tenants", "1,2", "--steps", "2", "--warmup", "1", "--batch", "2", "--seq-len", "16",
                           "--ref-steps", "3", "--ref-warmup", "1", "--point-timeout-s", "120", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    ref = r["reference"]
    t_ref = ref["t_ref_s"]["p50"]
    assert 0 < t_ref <= ref["t_ref_s"]["p90"] and len(ref["steps_s"]) == 3
    assert ref["tokens_per_s"] == pytest.approx(2 * 16 / t_ref)
    assert ref["mfu"] is None and "CPU" in ref["mfu_null_reason"]
    assert ref["peak_memory"]["peak_rss_bytes"] > 0 and ref["base_params"] > 0 and ref["lora_params"] > 0
    s = ref["settings"]
    assert s["attn_implementation"] == "sdpa" and s["gradient_checkpointing"] is False and s["mode"] == "model.train()"
    assert s["lora"]["r"] == 16 and {"q_proj", "down_proj", "lm_head"} <= set(s["lora"]["target_modules"])
    assert s["base_dtype"] == "float32" and s["autocast"] is None
    # think time is 4 x t_ref (no calibration at N = 1)
    assert r["think_basis"] == "think_ratio x t_ref" and r["think_s"] == pytest.approx(4 * t_ref)
    points = r["points"]
    assert [p["tenants"] for p in points] == [1, 2] and not any(p.get("failed") for p in points)
    for p in points:
        assert p["think_s"] == pytest.approx(4 * t_ref)
        assert p["aggregate_tokens_per_s"] > 0 and p["step_tokens_per_s"] == pytest.approx(32 / p["median_step_s"])
        assert p["mfu"] is None and "CPU" in p["mfu_null_reason"]
        assert p["p50_vs_ref"] == pytest.approx(p["median_step_s"] / t_ref)
        assert p["p90_vs_ref"] == pytest.approx(p["p90_step_s"] / t_ref)
    # density against t_ref; the one-tenant density is kept beside it
    dv = r["density_vs_reference"]
    assert dv["t_ref_s"] == t_ref and dv["limit_s"] == pytest.approx(1.25 * t_ref)
    want = max((p["tenants"] for p in points if p["median_step_s"] <= 1.25 * t_ref), default=0)
    assert r["density"] == dv["density"] == want
    assert r["density_vs_one_tenant"] == (2 if points[1]["latency_vs_alone"] <= 1.25 else 1)
    assert "vs the peft reference (t_ref p50" in proc.stderr and "x t_ref" in proc.stderr


def test_mfu_uses_the_peak_table():
    ref = _reference_module()
    h200 = {"device_name": "NVIDIA H200", "peak_bf16_flops": dict(ref.PEAK_BF16_FLOPS)["H200"], "reason": None}
    assert h200["peak_bf16_flops"] == 989.5e12
    # Qwen3-1.7B's 1.72 G parameters at 115k tokens/s: about the dense bf16 peak at 4 FLOPs per parameter-token
    assert ref.mfu(115e3, 1_720_000_000, h200) == pytest.approx(0.80, abs=0.01)
    assert ref.mfu(1e3, 10, ref.peak_flops("cpu")) is None
