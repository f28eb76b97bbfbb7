"""rota-adapter-fsdp's tests run torch on one thread; ``endpoint`` and ``torch_connect`` are rota's and rota_torch's
pytest plugins."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
