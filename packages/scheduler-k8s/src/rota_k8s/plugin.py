"""rota's ``k8s`` plugin: placement on Kubernetes and the ``rota k8s`` commands.

Registered through the ``rota`` entry-point group, so installing rota-scheduler-k8s
is enough for ``rota k8s ...`` to exist and for ``rota_place(scheduler="k8s")`` to
answer with the group's shared DRA ResourceClaim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota import hookimpl
from rota.types import Placement, TurnRequest

if TYPE_CHECKING:
    import click

SCHEDULER = "k8s"


@hookimpl
def rota_place(request: TurnRequest, scheduler: str) -> Placement | None:
    """Place a tenant of ``request.group_id`` on the node of the group's shared ResourceClaim."""
    if scheduler != SCHEDULER:
        return None
    from rota_k8s.workloads import CLAIM_API_VERSION, CLAIM_REQUEST, DEVICE_CLASS, claim_name
    from rota_k8s_controller.names import GROUP_LABEL, JOB_LABEL

    return Placement(scheduler=SCHEDULER, group_id=request.group_id, details={
        "resourceClaimName": claim_name(request.group_id),
        "resourceClaimApiVersion": CLAIM_API_VERSION,
        "deviceClassName": DEVICE_CLASS,
        "request": CLAIM_REQUEST,
        GROUP_LABEL: request.group_id,
        JOB_LABEL: request.job_id,
    })


@hookimpl(trylast=True)
def rota_cli(cli: click.Group) -> None:
    """Add ``rota k8s`` (render, tenant, controller, status); ``trylast``, so this group replaces
    rota_k8s_controller's (controller and install-key only) under the same name."""
    from rota.cli.lazy import LazyCommand

    cli.add_command(LazyCommand("k8s", "rota_k8s.cli:k8s",
                                "rota on Kubernetes: manifests, tenant workloads, the pod controller, status."))
