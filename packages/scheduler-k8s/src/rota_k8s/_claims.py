"""The one check ``rota k8s tenant`` makes against a cluster: does the group's claim ask
for the GPUs this tenant expects?

Every tenant of a group shares the group's ResourceClaim, so they must agree on its
GPU count. A claim's spec is immutable: applying the claim of a tenant that asks for
another count is refused by the API server, but the tenant's Job would still be
created and run on the claim's devices. ``rota k8s tenant --check-claim`` reads the
claim first and refuses, printing nothing, when its count differs.
"""

from __future__ import annotations

import json
from typing import Any

from rota.errors import InvalidArgument, RotaError
from rota_k8s.workloads import DEVICE_CLASS

__all__ = ["ClaimReadError", "check_claim", "claim_gpus", "read_claim"]


class ClaimReadError(RotaError):
    """The API server could not be asked for the claim (unreachable, refused, forbidden)."""


def claim_gpus(claim: dict[str, Any]) -> int | None:
    """GPUs (device class gpu.nvidia.com) a ResourceClaim asks for; None when the claim does not say a number.

    Counts ``exactly`` requests of that class (``allocationMode`` ExactCount, ``count``
    default 1). ``allocationMode: All``, ``firstAvailable`` lists or no such request at
    all leave the number open.
    """
    total = 0
    for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        exact = request.get("exactly")
        if exact is None:
            if request.get("firstAvailable"):
                return None
            continue
        if exact.get("deviceClassName") != DEVICE_CLASS:
            continue
        if exact.get("allocationMode", "ExactCount") != "ExactCount":
            return None
        total += int(exact.get("count") or 1)
    return total or None


def read_claim(api_client: Any, namespace: str, name: str, *, timeout: float | None = None) -> dict[str, Any] | None:
    """The ResourceClaim ``namespace/name`` as a dict, or None if it does not exist; waits ``timeout`` seconds
    (default: ROTA_CONNECT_TIMEOUT_S, else 10)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from rota.admin import client_timeout

    timeout = client_timeout(timeout)

    try:
        resp = client.ResourceV1Api(api_client).read_namespaced_resource_claim(
            name, namespace, _preload_content=False, _request_timeout=timeout)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise ClaimReadError(f"cannot read ResourceClaim {namespace}/{name}: HTTP {exc.status} {exc.reason}") from None
    except Exception as exc:  # connection refused, TLS, timeouts: urllib3 raises several kinds
        from rota_k8s._portforward import api_unreachable

        raise ClaimReadError(f"cannot read ResourceClaim {namespace}/{name}: "
                             f"{api_unreachable(api_client, exc, timeout)}") from None
    return json.loads(resp.data)


def check_claim(api_client: Any, *, group_id: str, namespace: str, name: str, gpus: int, must_exist: bool) -> str:
    """Refuse (InvalidArgument) a tenant whose ``gpus`` differ from the existing claim's; say what was found.

    :param must_exist: the claim was named with ``--claim`` (an existing claim), so its
        absence is an error too; the group's own claim is created by the first tenant.
    """
    claim = read_claim(api_client, namespace, name)
    if claim is None:
        if must_exist:
            raise InvalidArgument(f"ResourceClaim {namespace}/{name} (--claim) does not exist: create it first, or "
                                  "leave out --claim to use the group's own claim", group_id=group_id)
        return f"ResourceClaim {namespace}/{name} does not exist yet: this tenant creates it with {gpus} GPU(s)"
    found = claim_gpus(claim)
    if found is None:
        return (f"ResourceClaim {namespace}/{name} does not ask for a fixed number of {DEVICE_CLASS} devices; "
                f"not compared with --gpus {gpus}")
    if found != gpus:
        raise InvalidArgument(
            f"--gpus {gpus}, but ResourceClaim {namespace}/{name} of group {group_id!r} asks for {found} GPU(s), and "
            f"every tenant of a group shares that claim: use --gpus {found}, or another --group for "
            f"{gpus}-GPU tenants", group_id=group_id)
    return f"ResourceClaim {namespace}/{name} asks for {found} GPU(s), as this tenant does"
