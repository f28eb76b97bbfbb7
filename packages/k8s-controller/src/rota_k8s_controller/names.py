"""The names rota's Kubernetes objects share: tenant labels, rota's ids of a job, its token Secret.

``rota k8s tenant`` renders pods with these labels and ``ROTA_TOKEN`` from that Secret;
the controller reads the labels and writes the Secret. Both sides take them from here.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["DNS_LABEL", "GROUP_LABEL", "JOB_LABEL", "LABEL_VALUE", "PART_OF", "TOKEN_KEY", "dns_label",
           "dns_label_ok", "label_value_problem", "rota_ids", "token_secret_name"]

JOB_LABEL = "timeslice.io/job-id"
GROUP_LABEL = "timeslice.io/group"
PART_OF = "rota"  # app.kubernetes.io/part-of of every object rota makes
TOKEN_KEY = "token"  # the key of a job's token Secret's data
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")


def rota_ids(namespace: str, group: str, job: str) -> tuple[str, str]:
    """rota's (group id, job id) of a tenant pod: its namespace, a dot, and its label.

    A job is who may act for it, so its identity includes the namespace: the same
    ``timeslice.io/job-id`` in another team's namespace is another job, with another
    token. Groups too: a group is its ResourceClaim, and claims belong to one namespace.
    Namespaces hold no dot, so the id splits back unambiguously.
    """
    return f"{namespace}.{group}", f"{namespace}.{job}"


def token_secret_name(job_id: str) -> str:
    """Name of the Secret (in the tenant's namespace) holding the token of job ``job_id`` (its label value)."""
    return dns_label(job_id, prefix="rota-token-")


def dns_label_ok(text: str) -> bool:
    """True when ``text`` is a DNS-1123 label (a namespace name, for one)."""
    return bool(DNS_LABEL.fullmatch(text))


def label_value_problem(kind: str, value: str) -> str | None:
    """Why ``value`` cannot be a Kubernetes label value, or None if it can."""
    if not value or not LABEL_VALUE.fullmatch(value):
        return (f"{kind} {value!r} cannot be a Kubernetes label value: use 1-63 letters, digits, '-', '_', '.', "
                "starting and ending with a letter or digit")
    return None


def dns_label(text: str, *, prefix: str = "rota-") -> str:
    """A DNS-1123 label derived from ``text`` (lowercased, other characters to '-', hashed if changed)."""
    base = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    name = f"{prefix}{base}"
    if base != text or len(name) > 63:
        digest = hashlib.sha256(text.encode()).hexdigest()[:6]
        name = f"{name[:56].rstrip('-')}-{digest}"
    return name
