"""The devices a tenant may run on, and the per-device lanes of a group that spans several.

A group may span several GPUs of one host. A tenant names the devices it may use
(``rota.connect(devices=...)`` or ``ROTA_DEVICES``); the orchestrator then places each
of its turns on one of them and the grant names that device (``Grant.device``,
``Gpu.device``). Inside the orchestrator each device of group ``G`` is a *lane*, a group
state of its own named ``G@cuda:1`` (what ``rota status`` lists): at most one holder per
lane, so never two tenants on one device.

Names: ``cuda:N`` (or just ``N``), and ``fake:N`` for tests: a fake device is a name the
orchestrator places turns on, with no memory behind it (rota_torch refuses it). The
orchestrator takes only devices the host has (:func:`host_gpus`, or its ``--devices N``):
a lane of a device that does not exist would be a lane nobody else can use.
``all`` means every device this process sees: as many as ``CUDA_VISIBLE_DEVICES`` lists,
which Slurm sets from the job's GRES (``--gres=gpu:2``) and Kubernetes' NVIDIA device
plugin or DRA driver from the pod's claim.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from rota._ids import shown
from rota.errors import ConfigError

__all__ = ["FAKE_DEVICES", "LANE_SEP", "MAX_DEVICES", "device_index", "env_devices", "host_gpus", "lane_base",
           "lane_device", "lane_id", "parse_devices"]

MAX_DEVICES = 64  # devices one tenant may name (a host has at most a few dozen)
FAKE_DEVICES = 8  # fake:0 .. fake:7 exist for an orchestrator not told how many devices its host has
LANE_SEP = "@"  # never part of a group id (rota.config.check_id), so a lane cannot collide with a group
_NAME = re.compile(r"(cuda|fake):(\d{1,3})")
_GPU_NODE = re.compile(r"nvidia\d{1,3}")
_FIX = "name devices as cuda:N or N (e.g. 0,1 or cuda:0,cuda:1), fake:N in tests, or all"


def parse_devices(value: str | int | Iterable[str | int] | None, source: str = "devices") -> tuple[str, ...]:
    """Devices as canonical names (``cuda:0``...), in the order given; () for None or "".

    ``value``: a comma-separated string, an int, or a list of either. Raises
    :class:`rota.errors.ConfigError` naming ``source`` and the bad value: unknown names,
    duplicates, kinds mixed, more than :data:`MAX_DEVICES`.
    """
    if value is None:
        return ()
    if isinstance(value, bool):
        raise ConfigError(f"{source}={value!r} is not a device list; {_FIX}")
    if isinstance(value, int):
        items: list[str] = [str(value)]
    elif isinstance(value, str):
        if value.strip() == "all":
            return _visible(source)
        items = [p.strip() for p in value.split(",")] if value.strip() else []
    else:
        items = [str(v).strip() if not isinstance(v, bool) else "?" for v in value]
    if len(items) > MAX_DEVICES:
        raise ConfigError(f"{source} names {len(items)} devices; at most {MAX_DEVICES}")
    out: list[str] = []
    for item in items:
        name = f"cuda:{item}" if item.isdigit() and len(item) <= 3 else item
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{source}={shown(value)}: {shown(item)} is not a device; {_FIX}")
        name = f"{name.split(':')[0]}:{int(name.split(':')[1])}"  # cuda:01 -> cuda:1
        if name in out:
            raise ConfigError(f"{source}={shown(value)} names {name} twice; name each device once")
        out.append(name)
    if len({n.split(":")[0] for n in out}) > 1:
        raise ConfigError(f"{source}={shown(value)} mixes real and fake devices; use one kind")
    return tuple(out)


def _visible(source: str) -> tuple[str, ...]:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    entries = [e for e in (p.strip() for p in raw.split(",")) if e]
    if not entries or entries[0].startswith("-"):
        raise ConfigError(f"{source}=all needs CUDA_VISIBLE_DEVICES (set by Slurm's --gres=gpu:N and by a "
                          f"Kubernetes device claim), which is {raw!r} here; list the devices instead, e.g. 0,1")
    if len(entries) > MAX_DEVICES:
        raise ConfigError(f"{source}=all: CUDA_VISIBLE_DEVICES lists {len(entries)} devices; at most {MAX_DEVICES}")
    return tuple(f"cuda:{i}" for i in range(len(entries)))


def host_gpus(dev_root: str = "/dev") -> int:
    """GPUs of this host (or container): its NVIDIA device nodes, ``/dev/nvidia0``, ``/dev/nvidia1``...

    They exist wherever the driver is loaded (a container gets those of its GPUs), read
    without NVML or CUDA. 0 where there are none (a host without GPUs, an orchestrator
    that serves other hosts: there ``--devices N`` says how many their lanes may name).
    """
    try:
        names = os.listdir(dev_root)
    except OSError:
        return 0
    return sum(1 for n in names if _GPU_NODE.fullmatch(n))


def env_devices() -> tuple[str, ...]:
    """``ROTA_DEVICES``, parsed (() when unset)."""
    return parse_devices(os.environ.get("ROTA_DEVICES"), "ROTA_DEVICES")


def device_index(device: str) -> int:
    """The N of ``cuda:N`` / ``fake:N``."""
    return int(device.rpartition(":")[2])


def lane_id(group_id: str, device: str) -> str:
    """The lane of ``device`` in ``group_id`` (``G@cuda:1``)."""
    return f"{group_id}{LANE_SEP}{device}"


def lane_base(group_id: str) -> str:
    """The group a lane belongs to (a group id is its own base)."""
    return group_id.split(LANE_SEP, 1)[0]


def lane_device(group_id: str) -> str:
    """The device of a lane ("" for a group id)."""
    return group_id.partition(LANE_SEP)[2]
