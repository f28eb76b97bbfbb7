"""rota-torch's tests run torch on one thread; ``torch_connect`` (tenants whose models are untracked after) is
this package's pytest plugin, on rota's ``endpoint``."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
