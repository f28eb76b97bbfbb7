"""``rota k8s`` and ``kubectl rota``: render manifests, tenants, run the controller, status.

A thin click layer over :mod:`rota_k8s.manifests` and :mod:`rota_k8s._values`; the
``controller`` and ``install-key`` commands come from :mod:`rota_k8s_controller.cli`.
The same group is the ``kubectl-rota`` executable (kubectl's plugin convention: an
executable named ``kubectl-NAME`` on PATH makes ``kubectl NAME`` work). Nothing is
printed until every value and every rendered object has been validated.

Environment: ROTA_ORCHESTRATOR (orchestrator address for ``status``, ``controller``
and tenants), ROTA_GROUP (default ``--group``), ROTA_AUTH_KEY (the controller's
``--auth-key``), ROTA_TOKEN (``status``'s credential), ROTA_LOG_LEVEL (``kubectl rota`` only).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

import click

from rota import plugin_manager
from rota.cli.options import Endpoint
from rota.errors import DeadlineExceeded, InvalidArgument, RotaError, Unavailable
from rota.types import TurnRequest
from rota_k8s._values import ValuesError, load_values
from rota_k8s.manifests import render, to_yaml
from rota_k8s.workloads import MAX_GPUS, TenantSpec, claim_name, tenant
from rota_k8s_controller.cli import controller_cmd, install_key_cmd

log = logging.getLogger(__name__)


def _key_values(option: str, items: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=option)
        out[key] = value
    return out


def _emit(objs: list[dict[str, Any]], out_dir: str | None, versions: tuple[str, ...], validate: bool) -> None:
    if validate:
        from rota_k8s._validate import ManifestError, validate_objects  # kubernetes-validate: only when used

        try:
            checked = validate_objects(objs, versions or None)
        except ManifestError as exc:  # a bug in rota or a value the schema refuses: print nothing
            raise click.ClickException(str(exc)) from None
        log.info("validated %d objects against Kubernetes %s", len(objs), ", ".join(checked))
    if out_dir is None:
        click.echo(to_yaml(objs), nl=False)
        return
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    names = []
    for i, obj in enumerate(objs):
        names.append(f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml")
        (path / names[-1]).write_text(to_yaml([obj]))
    # A kustomize base of the same objects: overlays patch it (kubectl apply -k) without re-rendering.
    (path / "kustomization.yaml").write_text(to_yaml([{"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                                       "kind": "Kustomization", "resources": names}]))
    click.echo(f"wrote {len(objs)} objects and a kustomization.yaml to {path}/ (kubectl apply -k {path}/)",
               err=True)


def _kube_versions(_ctx: click.Context, _param: click.Parameter, given: tuple[str, ...]) -> tuple[str, ...]:
    """``--kube-version`` values as minor versions this installation can validate against (one-line errors)."""
    from rota_k8s._validate import MIN_VERSION, supported_versions

    known = supported_versions()
    out = []
    for text in given:
        match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?", text.strip())
        if not match:
            raise click.ClickException(f"--kube-version {text!r} is not a Kubernetes version; give MAJOR.MINOR, "
                                       f"one of {', '.join(known)}")
        minor = f"{int(match[1])}.{int(match[2])}"
        if minor not in known:
            raise click.ClickException(
                f"--kube-version {text!r} cannot be checked: rota's manifests need Kubernetes {MIN_VERSION} or later "
                f"(resource.k8s.io/v1, DRA) and this kubernetes-validate knows {', '.join(known)}")
        out.append(minor)
    return tuple(out)


_versions_option = click.option(
    "--kube-version", "versions", multiple=True, metavar="1.34", callback=_kube_versions,
    help="Validate against this Kubernetes minor version (repeatable). Default: every one from 1.34 on "
    "that kubernetes-validate knows.")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def k8s() -> None:
    """rota on Kubernetes: manifests, tenant workloads, the pod controller, status."""


k8s.add_command(controller_cmd)  # run in the cluster; rota-k8s-controller holds them
k8s.add_command(install_key_cmd)


@k8s.command("render")
@click.option("-f", "--values", "values_file", type=click.Path(dir_okay=False),
              help="YAML values file (see README 'Kubernetes'); flags override it.")
@click.option("--namespace", help="Namespace of rota's own objects [rota-system].")
@click.option("--tenant-namespace", "tenant_namespaces", multiple=True, metavar="NS",
              help="Namespace whose pods may use rota (repeatable) [default]: the controller watches it, writes job "
              "tokens there, and the NetworkPolicies admit its tenant pods.")
@click.option("--agent-namespace", help="Namespace of the agent DaemonSet, the only privileged one "
              "[NAMESPACE-agent].")
@click.option("--image", help="rota image for orchestrator, controller and agent [rota:0.1.0].")
@click.option("--image-pull-policy", help="Always, IfNotPresent or Never [IfNotPresent].")
@click.option("--etcd", "etcd_endpoints", help="Comma-separated https:// URLs of an existing etcd: no etcd "
              "StatefulSet is rendered (the orchestrator presents etcd.clientSecret's certificate).")
@click.option("--etcd-replicas", type=int, help="Members of the rendered etcd StatefulSet (odd) [3].")
@click.option("--orchestrator-replicas", type=int, help="Orchestrator replicas (leader-elected) [2].")
@click.option("--policy", help="fifo, priority, fair or a policy an installed plugin registers [fifo].")
@click.option("--ttl", type=float, help="Seconds without heartbeat before a tenant loses its turn [10].")
@click.option("--park-timeout", type=float, help="Seconds a park may take before the job is FAULTED [120].")
@click.option("--max-turn", type=float, help="Seconds a holder may keep a group while others wait; 0 = no limit.")
@click.option("--node-selector", multiple=True, metavar="KEY=VALUE",
              help="Nodes that get an agent (repeatable; replaces the default nvidia.com/gpu.present=true).")
@click.option("--agent-port", type=int, help="Agent gRPC port [9001].")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False), help="Write one file per object here.")
@_versions_option
@click.option("--validate/--no-validate", default=True, show_default=True,
              help="Check every object against the official Kubernetes schemas before printing.")
def render_cmd(values_file: str | None, namespace: str | None, tenant_namespaces: tuple[str, ...],
               agent_namespace: str | None, image: str | None, image_pull_policy: str | None,
               etcd_endpoints: str | None, etcd_replicas: int | None, orchestrator_replicas: int | None,
               policy: str | None, ttl: float | None, park_timeout: float | None, max_turn: float | None,
               node_selector: tuple[str, ...], agent_port: int | None, output_dir: str | None,
               versions: tuple[str, ...], validate: bool) -> None:
    """Print everything a cluster needs, for `| kubectl apply -f -`.

    Namespaces (Pod Security labels), RBAC, NetworkPolicies, etcd (3 members, mutual
    TLS) or a pointer to yours, the orchestrator Deployment (2 replicas) with the pod
    controller, the agent DaemonSet on GPU nodes, Services and PodDisruptionBudgets.
    Secrets are referenced, never rendered: make the auth key and etcd's certificates
    first (README 'Credentials').
    """
    overrides: dict[str, Any] = {}
    flat = {"namespace": namespace, "image": image, "imagePullPolicy": image_pull_policy,
            "tenantNamespaces": list(tenant_namespaces) or None}
    overrides.update({k: v for k, v in flat.items() if v is not None})
    sections = {
        "etcd": {"endpoints": etcd_endpoints, "replicas": etcd_replicas},
        "orchestrator": {"replicas": orchestrator_replicas, "policy": policy, "ttl": ttl,
                         "parkTimeout": park_timeout, "maxTurn": max_turn},
        "agent": {"port": agent_port, "nodeSelector": _key_values("--node-selector", node_selector) or None,
                  "namespace": agent_namespace},
    }
    for name, section in sections.items():
        given = {k: v for k, v in section.items() if v is not None}
        if given:
            overrides[name] = given
    try:
        values = load_values(values_file, overrides)
    except ValuesError as exc:
        raise click.UsageError(str(exc)) from None
    _emit(render(values), output_dir, versions, validate)


@k8s.command("tenant", context_settings={"ignore_unknown_options": False})
@click.option("--group", required=True, envvar="ROTA_GROUP", help="Group whose GPU the tenant shares (env ROTA_GROUP).")
@click.option("--image", required=True, help="Container image of the tenant.")
@click.option("--job-id", help="Tenant id (label timeslice.io/job-id) [GROUP-<random>].")
@click.option("--namespace", default="default", show_default=True, help="Namespace of the tenant and claim.")
@click.option("--kind", type=click.Choice(["job", "pod"]), default="job", show_default=True,
              help="An Indexed Job (one pod per rank) or a bare Pod.")
@click.option("--gpus", type=int, default=1, show_default=True,
              help=f"GPUs of the group's claim, all on one node (1-{MAX_GPUS}); every tenant of the group must give "
              "the same N. With N > 1 the job is one pod holding the N GPUs that starts one process per GPU "
              "(torchrun --nproc-per-node N); see 'Ranks and GPUs' above.")
@click.option("--ranks", type=int, default=1, show_default=True,
              help="Pods of the job, one rank each (ROTA_RANK = the Job's completion index). Must be 1 with "
              "--gpus > 1.")
@click.option("--orchestrator", type=Endpoint(), default="rota-orchestrator.rota-system.svc:50051",
              show_default=True, help="Orchestrator address as seen from the tenant pod.")
@click.option("--agent", default="rota-agent.rota-system-agent.svc:9001", show_default=True, type=Endpoint(),
              help="The agent's Service as seen from the tenant pod (it routes to the agent of the pod's node).")
@click.option("--claim", default="", help="Use this existing ResourceClaim instead of the group's own.")
@click.option("--with-claim/--no-claim", default=True, show_default=True,
              help="Also print the group's ResourceClaim (applying it again is a no-op).")
@click.option("--check-claim", is_flag=True,
              help="Read the group's claim (or --claim) from the API server first; refuse, printing nothing, if it "
              "asks for another number of GPUs than --gpus.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False),
              help="kubeconfig for --check-claim (default: in-cluster service account, else $KUBECONFIG or "
              "~/.kube/config).")
@click.option("--context", "kube_context", help="kubeconfig context for --check-claim.")
@click.option("--run-as-user", type=int, default=1000, show_default=True,
              help="uid of the tenant's processes (never 0: tenant pods pass Pod Security 'restricted').")
@click.option("--token/--no-token", default=True, show_default=True,
              help="ROTA_TOKEN from the job's Secret rota-token-JOB, which the controller writes when it sees the pod. "
              "--no-token only for an orchestrator served with --insecure.")
@click.option("--priority", type=int, default=0, help="ROTA_PRIORITY (priority policy).")
@click.option("--weight", type=float, default=1.0, help="ROTA_WEIGHT (fair-share policy).")
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="Extra environment (repeatable).")
@_versions_option
@click.option("--validate/--no-validate", default=True, show_default=True,
              help="Check the objects against the official Kubernetes schemas before printing.")
@click.argument("command", nargs=-1, required=True)
def tenant_cmd(group: str, image: str, job_id: str | None, namespace: str, kind: str, gpus: int, ranks: int,
               orchestrator: str, agent: str, claim: str, with_claim: bool, check_claim: bool,
               kubeconfig: str | None, kube_context: str | None, run_as_user: int, token: bool, priority: int,
               weight: float,
               env: tuple[str, ...], versions: tuple[str, ...], validate: bool, command: tuple[str, ...]) -> None:
    """Print a tenant workload of GROUP running COMMAND (give it after `--`).

    Every tenant of a group references the group's one DRA ResourceClaim
    (resource.k8s.io/v1, device class gpu.nvidia.com, --gpus devices of one node),
    so they share its GPUs and take turns through rota. The pods get ROTA_* env; rota's
    ids are NAMESPACE.GROUP and NAMESPACE.JOB, from the pod's namespace and labels through
    the downward API, and ROTA_TOKEN comes from the job's Secret (rota-token-JOB), which
    the controller writes. The pods run as --run-as-user, never root.

    \b
    Ranks and GPUs:
      --gpus 1 --ranks R   R pods on the group's GPU, ROTA_RANK = completion index,
                           ROTA_WORLD_SIZE = R (one process per pod calls rota.connect()).
      --gpus N (N > 1)     one pod with all N GPUs; run one process per GPU, e.g.
                           -- torchrun --nproc-per-node N train.py. The pod gets no
                           ROTA_RANK/ROTA_WORLD_SIZE: rota.connect() in each process
                           takes rank and world size from torchrun's RANK and
                           WORLD_SIZE; LOCAL_RANK picks the process's GPU
                           (cuda:LOCAL_RANK).

    Every tenant of a group must give the same --gpus (the claim's spec is immutable:
    the API server refuses a claim with another count); --check-claim compares with
    the claim in the cluster before printing anything.
    """
    job_id = job_id or f"{group}-{secrets.token_hex(3)}"
    placement = plugin_manager().hook.rota_place(
        request=TurnRequest(job_id=job_id, group_id=group, priority=priority, weight=weight, world_size=ranks),
        scheduler="k8s")
    spec = TenantSpec(group_id=group, job_id=job_id, image=image, command=command, namespace=namespace,
                      kind="Job" if kind == "job" else "Pod", world_size=ranks, gpus=gpus, orchestrator=orchestrator,
                      agent=agent, run_as_user=run_as_user, token=token,
                      claim=claim or (placement.details.get("resourceClaimName", "") if placement else ""),
                      priority=priority, weight=weight, env=_key_values("--env", env))
    try:
        objs = tenant(spec, with_claim=with_claim and not claim)  # a claim named by --claim exists already
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
    if check_claim:
        _check_claim(spec, kubeconfig, kube_context, must_exist=bool(claim))
    _emit(objs, None, versions, validate)


def _check_claim(spec: TenantSpec, kubeconfig: str | None, kube_context: str | None, *, must_exist: bool) -> None:
    """``--check-claim``: refuse a tenant whose --gpus differ from the group's claim in the cluster."""
    from rota_k8s._claims import ClaimReadError, check_claim
    from rota_k8s_controller.controller import api_client_from_environment

    try:
        api = api_client_from_environment(kubeconfig, kube_context, retries=0)
    except Exception as exc:
        raise click.ClickException(f"--check-claim: no Kubernetes configuration: {exc}") from None
    try:
        found = check_claim(api, group_id=spec.group_id, namespace=spec.namespace,
                            name=spec.claim or claim_name(spec.group_id), gpus=spec.gpus, must_exist=must_exist)
    except ClaimReadError as exc:
        raise click.ClickException(f"--check-claim: {exc}") from None
    except InvalidArgument as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"rota: {found}", err=True)


@k8s.command("status")
@click.argument("group", required=False, default="")
@click.option("--orchestrator", "endpoint", type=Endpoint(), envvar="ROTA_ORCHESTRATOR",
              help="Orchestrator address (env ROTA_ORCHESTRATOR). Default: a ready orchestrator pod of --namespace, "
              "reached through the API server (a port-forward, as `kubectl port-forward` makes).")
@click.option("--namespace", default="rota-system", show_default=True, help="rota's namespace in the cluster.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), help="kubeconfig [$KUBECONFIG or ~/.kube/config].")
@click.option("--context", "kube_context", help="kubeconfig context.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the schema of `rota status --json`).")
@click.option("--prometheus", is_flag=True, help="Print Prometheus text-format metrics.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds to wait for the API server and for the orchestrator, each (default: "
              "ROTA_CONNECT_TIMEOUT_S, else 10).")
def status_cmd(group: str, endpoint: str | None, namespace: str, kubeconfig: str | None, kube_context: str | None,
               as_json: bool, prometheus: bool, timeout: float | None) -> None:
    """Holder, queue and per-tenant accounting of GROUP (or every group).

    The orchestrator checks credentials: set ROTA_TOKEN to an admin token
    (`rota token issue --auth-key KEY --admin`), or to a job's token to see its group.
    """
    from rota.admin import client_timeout, fetch_status
    from rota.cli.status import print_status
    from rota_k8s._portforward import PodForward, ready_pod
    from rota_k8s_controller.names import dns_label_ok

    if as_json and prometheus:
        raise click.UsageError("choose one of --json and --prometheus")
    try:
        wait = client_timeout(timeout)
        if endpoint:
            where, reply = endpoint, fetch_status(endpoint, group, wait)
        else:
            if not dns_label_ok(namespace):
                raise click.BadParameter(f"{namespace!r} is not a namespace name", param_hint="--namespace")
            api = _core_api(kubeconfig, kube_context)
            pod = ready_pod(api, namespace, timeout=wait)
            where = f"pod {namespace}/{pod}"
            with PodForward(api, namespace, pod, 50051) as forward:
                try:
                    reply = fetch_status(forward.address, group, wait)
                except (DeadlineExceeded, Unavailable) as exc:  # name the pod, not the port-forward's loopback end
                    raise type(exc)(str(exc).replace(f"at {forward.address}", f"in {where} (through the API "
                                                     "server's port-forward)")) from None
    except RotaError as exc:
        raise click.ClickException(str(exc) if endpoint else f"the orchestrator: {exc}") from None
    log.info("status from %s", where)
    print_status(reply, as_json, prometheus)  # as `rota status` prints it


def _core_api(kubeconfig: str | None, kube_context: str | None) -> Any:
    """CoreV1Api from the kubeconfig (or in-cluster); one-line error naming the problem."""
    from rota_k8s_controller.controller import core_api_from_environment

    try:
        return core_api_from_environment(kubeconfig, kube_context, retries=0)
    except Exception as exc:
        raise click.ClickException(f"no Kubernetes configuration ({exc}); give --kubeconfig/--context, or "
                                   "--orchestrator HOST:PORT") from None


@k8s.command("image")
@click.option("--tag", default="", help="Image tag [rota:VERSION, the manifests' default --image].")
@click.option("--context", "context_dir", default=".", show_default=True, type=click.Path(file_okay=False),
              help="A checkout of the rota repository (its root holds the Dockerfile).")
@click.option("--build", is_flag=True, help="Run the build with docker (or podman) instead of printing it.")
def image_cmd(tag: str, context_dir: str, build: bool) -> None:
    """Build the rota image (orchestrator, controller, agent) from the repository's Dockerfile.

    Prints the command unless --build. Push the image where your nodes pull from and
    render with it: `rota k8s render --image REGISTRY/rota:VERSION`.
    """
    import shutil
    import subprocess

    from rota_k8s._image import default_image, image_problem

    tag = tag or default_image()
    problem = image_problem(tag)
    if problem:
        raise click.ClickException(f"--tag {tag!r} is not a container image reference: it {problem}")
    dockerfile = Path(context_dir) / "Dockerfile"
    tool = shutil.which("docker") or shutil.which("podman") or "docker"
    argv = [Path(tool).name, "build", "-t", tag, "-f", str(dockerfile), context_dir]
    if not build:
        click.echo(" ".join(argv))
        click.echo(f"# then: docker push REGISTRY/{tag} (after docker tag) and rota k8s render --image "
                   f"REGISTRY/{tag}", err=True)
        return
    if not dockerfile.is_file():
        raise click.ClickException(f"{dockerfile} not found: give --context, a checkout of the rota repository")
    if not shutil.which(tool):
        raise click.ClickException("neither docker nor podman is on PATH; run the printed command where one is")
    sys.exit(subprocess.call([tool, *argv[1:]]))


@k8s.command("versions")
def versions_cmd() -> None:
    """Kubernetes versions the rendered manifests are validated against."""
    from rota_k8s._validate import supported_versions

    click.echo(" ".join(supported_versions()))


def kubectl_main() -> None:
    """Entry point of ``kubectl-rota`` (so ``kubectl rota status|render|tenant`` work)."""
    level = os.environ.get("ROTA_LOG_LEVEL", "warning").upper()
    logging.basicConfig(level=level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "WARNING",
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        k8s.main(prog_name="kubectl rota", standalone_mode=True)
    except RotaError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
