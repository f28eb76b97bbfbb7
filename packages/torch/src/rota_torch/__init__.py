"""rota_torch: park tagged torch tensors between a tenant's turns, for every torch adapter.

Two layers:

* the parker — :class:`TensorParker` tracks tensors by tag, parks them by *distinct
  untyped storage* into one reused :class:`HostPool` (pinned on CUDA, ordinary memory
  on CPU so the same code path is testable anywhere) and restores the same storages,
  so tensor, parameter and storage identities survive; :func:`overlap` parks one
  parker while restoring another; :func:`name_untracked` and
  :func:`outside_allocator_bytes` name what a park left behind; :func:`allocation_range` is
  the driver's word on which allocation holds an address (a copy never crosses two).
* the adapter contract — :class:`Tracked`, the base every trainer adapter subclasses
  (``rota_fsdp``, ``rota_megatron``): one registry of tracked models, parameters and
  devices, the tag and device checks, the guards (no park during a turn or a backward
  pass, no forward while parked), verify/deadline/recreate, and the rota hooks. A
  subclass says *which* tensors make up its job through :meth:`Tracked.weights`,
  :meth:`Tracked.grads`, :meth:`Tracked.optimizer_state` and
  :meth:`Tracked.pool_estimate`. :class:`WorkingSet` adds what a tenant's turns need beyond
  its tracked tensors (their peak CUDA cache) to its footprint, so a capacity counts it, and
  the tenant keeps that cache between turns (:func:`counts_cache`).

Imports torch (``torch>=2.4,<2.15``, the range of every trainer adapter); rota-core does not.
"""

from __future__ import annotations

from rota.residue import ResidueError
from rota_torch._copies import allocation_range
from rota_torch._guard import (
    VERIFY_MODES,
    DiscardedTag,
    NoRoom,
    StateChanged,
    SwitchError,
    SwitchTimeout,
    VerifyError,
    env_verify,
)
from rota_torch._ledger import node_host_bytes
from rota_torch._overlap import overlap
from rota_torch._parker import NamedTensors, TensorParker, local_tensor
from rota_torch._pool import HostBudgetExceeded, HostPool, align, host_bytes_in_use
from rota_torch._residue import (
    collect_if_over,
    give_back_workspaces,
    name_untracked,
    outside_allocator_bytes,
    process_device_bytes,
)
from rota_torch._working import WorkingSet, counts_cache
from rota_torch.errors import AlreadyTracked, BackwardInFlight, DeviceMismatch, HoldsTurn, TrackingError
from rota_torch.tracked import TAGS, Tracked, check_tags, switch, tracked_models

__all__ = ["TAGS", "VERIFY_MODES", "AlreadyTracked", "BackwardInFlight", "DeviceMismatch", "DiscardedTag",
           "HoldsTurn", "HostBudgetExceeded", "HostPool", "NamedTensors", "NoRoom", "ResidueError", "StateChanged",
           "SwitchError", "SwitchTimeout", "TensorParker", "Tracked", "TrackingError", "VerifyError", "WorkingSet",
           "align", "allocation_range",
           "check_tags", "collect_if_over", "counts_cache", "env_verify", "give_back_workspaces", "host_bytes_in_use",
           "local_tensor",
           "name_untracked", "node_host_bytes", "outside_allocator_bytes", "overlap",
           "process_device_bytes", "switch", "tracked_models"]
