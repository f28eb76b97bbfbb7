"""Switch guarantees of :mod:`rota_torch`: checked restores, deadlines, room checks, residue.

Who uses it: :class:`rota_torch.TensorParker` (fingerprints, deadlines, restore
room check, residue of tracked storages) and torch adapters (``rota_fsdp``) for the
configuration below and the error types they raise to the client, which turns them
into a FAULT of the job with the message as its cause.

Verification modes (``verify=`` or ``ROTA_VERIFY``):

* ``off`` — nothing is checked.
* ``sample`` (default) — at park, after the copies are done, a few 64-byte windows
  of every region's *host copy* are gathered (one indexed read over all regions); at
  restore the same windows are read again and compared before anything is copied
  back. Cost: at most a kilobyte per region. Catches host buffers that were
  overwritten, zeroed or handed to somebody else.
* ``full`` — at park a checksum of every region's *device* bytes (64-bit wrapping
  sum of its words, plus its tail bytes) is taken on the device before the region
  is freed; at restore the same checksum is taken on the device after the copy-in
  and compared before the turn starts. Checks the whole round trip; costs one
  read of the state on the device per park and per restore.

A restore that fails a check (or runs past its deadline, or finds no room) is rolled
back: the regions are freed again and the parker stays parked with its host copy
intact, so the restore can be retried and the host copy still checkpointed.

Environment (each value is validated; errors name the value and the fix):
    ROTA_VERIFY              off | sample | full (default sample)
    ROTA_SWITCH_DEADLINE_S   seconds one park or restore may take (default 0 = none)
    ROTA_RESIDUE_MAX_BYTES   device bytes a parked tenant may leave behind before the
                             park is a fault (a size; default 256 MiB; see rota.residue)
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from rota.errors import ConfigError, PermanentError, TransientError

if TYPE_CHECKING:
    from rota_torch._pool import HostPool

VERIFY_MODES = ("off", "sample", "full")
SAMPLES = 16  # windows hashed per region in sample mode
WINDOW = 64  # bytes per window


class SwitchError(PermanentError):
    """A park or restore could not be completed; it was rolled back (see the message)."""


class VerifyError(SwitchError):
    """A restored region's bytes differ from what was parked: the restore was refused."""


class StateChanged(SwitchError):
    """A tracked tensor was freed or resized by other code while it was being parked: nothing was freed."""


class DiscardedTag(SwitchError):
    """A tag parked in discard mode has no way to be re-created: it is not presented as restored."""


class SwitchTimeout(TransientError):
    """A park or restore ran past its deadline and was rolled back."""


class NoRoom(TransientError):
    """The device lacks free memory for a restore; nothing was allocated."""


def check_verify(value: str, source: str = "verify") -> str:
    """``value`` if it is a verification mode, else a :class:`ConfigError` naming it."""
    if value not in VERIFY_MODES:
        raise ConfigError(f"{source}={value!r} is not a verification mode; use one of {', '.join(VERIFY_MODES)}")
    return value


def env_verify() -> str:
    """``ROTA_VERIFY`` (default ``sample``), validated."""
    return check_verify(os.environ.get("ROTA_VERIFY") or "sample", "ROTA_VERIFY")


def check_non_negative(name: str, value: float | None) -> None:
    """Raise :class:`ConfigError` when ``value`` is negative."""
    if value is not None and value < 0:
        raise ConfigError(f"{name}={value!r} is negative; pass a value >= 0 (0 disables it)")


class Deadline:
    """A point in time a switch step must finish by; ``seconds`` of 0 or None means never."""

    def __init__(self, seconds: float | None, what: str) -> None:
        self.seconds = seconds or 0.0
        self.what = what
        self.at = time.monotonic() + self.seconds if self.seconds else float("inf")

    def left(self) -> float:
        return self.at - time.monotonic()

    def check(self, step: str) -> None:
        """Raise :class:`SwitchTimeout` when the deadline has passed (``step`` says where)."""
        if time.monotonic() > self.at:
            raise SwitchTimeout(f"{self.what}: ran past its {self.seconds:g} s deadline at {step}; rolled back "
                                "(raise ROTA_SWITCH_DEADLINE_S / deadline_s if the state is just large)")


def sample_index(offsets: list[int], sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool *word* positions (8-byte units) read in sample mode, sorted, and the region of each.

    A region of at most ``SAMPLES * WINDOW`` bytes is read whole; a larger one in
    ``SAMPLES`` windows of ``WINDOW`` bytes: first, last and evenly spread. A region's
    last word may include alignment padding after it, which no copy writes. Built with
    a few tensor operations over all regions at once (a Python loop per region cost 40%
    of a 4 GB switch) and sorted, so the pool reads each of its chunks with one
    ``index_select``. Offsets must be multiples of 8 (pool slots are 512-aligned).
    """
    if not offsets:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    off = torch.tensor(offsets, dtype=torch.int64) // 8
    words = (torch.tensor(sizes, dtype=torch.int64) + 7) // 8
    per_window, whole = WINDOW // 8, SAMPLES * WINDOW // 8
    share = words.clamp(max=whole)
    ends = share.cumsum(0)
    region = torch.repeat_interleave(torch.arange(len(offsets)), share)
    j = torch.arange(int(ends[-1])) - (ends - share)[region]  # word within the region's share
    n = words[region]
    windowed = (j // per_window) * (n - per_window) // (SAMPLES - 1) + j % per_window  # last window ends the region
    positions = off[region] + torch.where(n > whole, windowed, j)
    order = torch.argsort(positions, stable=True)
    return positions[order], region[order]


def device_checksum(dev: torch.Tensor) -> torch.Tensor:
    """A 2-element int64 tensor on ``dev``'s device: wrapping sum of its 8-byte words, sum of its tail."""
    n = dev.numel()
    whole = n // 8 * 8
    words = dev[:whole].view(torch.int64).sum() if whole else torch.zeros((), dtype=torch.int64, device=dev.device)
    tail = dev[whole:].to(torch.int64).sum() if n > whole else torch.zeros((), dtype=torch.int64, device=dev.device)
    return torch.stack([words, tail])


def device_free_bytes(device: torch.device) -> int | None:
    """Free bytes on ``device`` (CUDA: ``mem_get_info`` plus this process's cached blocks); None if unknown."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(cached, 0))


class HostSample:
    """``verify="sample"``: the words of a park's host copies at :func:`sample_index` positions, read after the
    copies are done, and the check at restore that the host copies still hold them. The index is built once
    per layout of the regions in the pool (a tenant parks the same storages each time)."""

    def __init__(self) -> None:
        self._layout: list[tuple[int, int]] = []
        self._index = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
        self._taken: tuple[list[Any], torch.Tensor] | None = None  # (copied regions, their words)

    def prepare(self, copied: list[Any]) -> None:
        """Build the index for ``copied``'s layout if it changed. A park calls it while its copies are in flight,
        so that a first park (a new layout: tens of ms for 800 storages on the GPU hosts) does not wait for it."""
        layout = [(sl.offset, sl.nbytes) for sl in copied]
        if self._layout != layout:
            self._layout = layout
            self._index = sample_index([o for o, _ in layout], [n for _, n in layout])

    def take(self, pool: HostPool, copied: list[Any]) -> None:
        """Read the sampled words of ``copied`` (regions with ``offset`` and ``nbytes`` in ``pool``)."""
        self.prepare(copied)
        self._taken = (copied, pool.gather_words(self._index[0]))

    def clear(self) -> None:
        self._taken = None

    @property
    def taken(self) -> bool:
        return self._taken is not None

    def check(self, pool: HostPool, who: str) -> None:
        """Compare the sampled words with the park's; :class:`VerifyError` names the first region that differs."""
        if self._taken is None:
            return
        copied, words = self._taken
        positions, regions = self._index
        now = pool.gather_words(positions)
        if torch.equal(now, words):
            return
        sl = copied[int(regions[int((now != words).nonzero()[0, 0])])]
        raise VerifyError(f"{who}: host copy of {sl.name!r} (tag {sl.tag!r}, {sl.nbytes} bytes) does not match its "
                          "fingerprint taken at park; restore refused, the tenant stays parked (host memory "
                          "corrupted or overwritten)")


def host_sums(sums: list[Any]) -> list[tuple[int, ...]]:
    """``verify="full"``: the :func:`device_checksum` of each copied region, read to the host in one copy."""
    return [tuple(fp) for fp in torch.stack(sums).cpu().tolist()] if sums else []


def check_restored_sums(who: str, copied: list[Any], sums: list[tuple[int, ...]]) -> None:
    """``verify="full"``: the restored regions' :func:`host_sums` against those taken at park (``fp``)."""
    for sl, fp in zip(copied, sums, strict=True):
        if sl.fp is not None and fp != sl.fp:
            raise VerifyError(f"{who}: restored bytes of {sl.name!r} (tag {sl.tag!r}, {sl.nbytes} bytes) do not "
                              "match the checksum taken at park; restore refused and rolled back, the tenant stays "
                              "parked")


__all__ = ["DiscardedTag", "NoRoom", "SwitchError", "SwitchTimeout", "VerifyError",
           "check_verify", "env_verify"]
