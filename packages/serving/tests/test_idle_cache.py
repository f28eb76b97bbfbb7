"""release_idle_cache: an in-process engine's park hands back what this process cached for pushed weights."""

from __future__ import annotations

import subprocess
import sys

import torch

from rota_serving import release_idle_cache


def test_a_process_without_cuda_hands_back_nothing_and_starts_no_cuda():
    assert release_idle_cache() == 0
    assert not torch.cuda.is_initialized()
    code = "import sys, rota_serving; rota_serving.release_idle_cache(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # never imports torch for it


def test_where_cuda_started_the_idle_cache_is_emptied_and_measured(monkeypatch):
    # a fake device (named so): this machine has no CUDA; tests/cuda/test_sglang_cuda.py checks it on a GPU
    reserved = [3 << 30]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[0])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: reserved.__setitem__(0, 1 << 30))
    assert release_idle_cache() == 2 << 30
    assert reserved == [1 << 30]
