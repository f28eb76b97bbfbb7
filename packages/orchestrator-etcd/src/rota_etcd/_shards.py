"""Which shard a group belongs to, and which live replica should lead each shard.

Groups are hashed into a fixed number of shards (``ROTA_ETCD_SHARDS``, the same on
every replica; etcd records it and a replica configured otherwise refuses to start).
Each shard has its own leader key and term, so replicas lead disjoint shares.

:func:`assign` maps shards to live replicas by rendezvous hashing with a load bound
(no replica gets more than ceil(shards / replicas)): balanced, and when a replica
joins or leaves mostly only the shards it gains or held move. It only says who
*should* campaign first; correctness comes from the per-shard election and fencing.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Sequence

from rota.devices import lane_base


def shard_of(group_id: str, shards: int) -> int:
    """The shard of ``group_id`` among ``shards`` (stable across processes and hosts); a lane of a group
    over several GPUs (``G@cuda:1``, :mod:`rota.devices`) is in its group's shard, led with it."""
    return zlib.crc32(lane_base(group_id).encode()) % shards if shards > 1 else 0


def _score(shard: int, replica: str) -> bytes:
    return hashlib.blake2b(f"{shard}/{replica}".encode(), digest_size=8).digest()


def assign(shards: int, replicas: Sequence[str]) -> dict[int, str]:
    """shard -> the replica that should lead it, for these live replica ids."""
    live = sorted(set(replicas))
    if not live:
        return {}
    cap = math.ceil(shards / len(live))
    load = dict.fromkeys(live, 0)
    out: dict[int, str] = {}
    for shard in range(shards):
        for replica in sorted(live, key=lambda r: _score(shard, r), reverse=True):
            if load[replica] < cap:
                out[shard] = replica
                load[replica] += 1
                break
    return out


__all__ = ["assign", "shard_of"]
