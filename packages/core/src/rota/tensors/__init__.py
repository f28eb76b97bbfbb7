"""Region-level parking of tagged tensors: the engine every torch adapter shares.

Adapters (``rota_fsdp``, later ``rota_megatron``) know *which* tensors matter and how
they are tagged (weights, grads, optimizer, ...). This subpackage knows *how* to move
them to host memory and back fast and without breaking anybody's references:

* :class:`HostPool` — one host buffer (pinned on CUDA, ordinary memory on CPU so the
  same code path is testable anywhere), allocated once, reused every turn, grown only
  when the tracked storages grow. Its :attr:`HostPool.allocations` counter lets tests
  prove that no switch allocates.
* :class:`TensorParker` — tracks tensors by tag, parks them by *distinct untyped
  storage* (copy everything out, then free each storage once with ``resize_(0)``), and
  restores by resizing the same storages back and copying in. Tensor, parameter and
  storage identities survive, so optimizer and module references stay valid.
* :func:`overlap` — park one parker while restoring another on separate streams.
* :func:`name_untracked`, :func:`outside_allocator_bytes` — what a park left behind,
  by name, and device memory outside torch's allocator (NVML), for residue reports.

This is the only part of rota-core that imports torch (install ``rota-core[demo]`` or
any torch adapter); nothing outside ``rota.tensors`` imports it.
"""

from __future__ import annotations

from rota.residue import ResidueError
from rota.tensors._guard import DiscardedTag, NoRoom, SwitchError, SwitchTimeout, VerifyError
from rota.tensors._ledger import node_host_bytes
from rota.tensors._parker import NamedTensors, TensorParker, local_tensor, overlap
from rota.tensors._pool import HostBudgetExceeded, HostPool, align, host_bytes_in_use
from rota.tensors._residue import name_untracked, outside_allocator_bytes, process_device_bytes

__all__ = ["DiscardedTag", "HostBudgetExceeded", "HostPool", "NamedTensors", "NoRoom", "ResidueError", "SwitchError",
           "SwitchTimeout", "TensorParker", "VerifyError", "align", "host_bytes_in_use", "local_tensor",
           "name_untracked", "node_host_bytes", "outside_allocator_bytes", "overlap", "process_device_bytes"]
