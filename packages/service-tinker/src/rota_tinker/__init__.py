"""rota_tinker: a Tinker-API-compatible training and sampling service whose tenants take turns on GPUs.

Users keep their ``tinker`` SDK loops (``forward_backward``, ``optim_step``,
``save_weights_for_sampler``, ``sample``); each API key is a tenant with its own trainer
and sampler worker processes, and every work unit runs inside a rota turn, so several
tenants (full-parameter or LoRA) share devices without knowing it::

    from rota_tinker import ServiceConfig, Tenant, TinkerService
    cfg = ServiceConfig(tenants=(Tenant("alice", "tml-alice-key-1"),), data_dir="/tmp/tinker")
    with TinkerService(cfg) as svc:      # TINKER_BASE_URL=svc.url
        ...

``rota tinker serve`` runs it from the command line.
"""

from rota_tinker._config import (
    DEFAULT_BASE_MODELS,
    BaseModelSpec,
    ServiceConfig,
    Tenant,
    parse_base_model,
    parse_keys,
)
from rota_tinker._hf import HfModelSpec, find_models, search_dirs

__all__ = ["DEFAULT_BASE_MODELS", "BaseModelSpec", "HfModelSpec", "ServiceConfig", "Tenant", "TinkerService",
           "find_models", "parse_base_model", "parse_keys", "save_base", "search_dirs"]


def save_base(spec: BaseModelSpec, path: str) -> None:
    """Write ``spec``'s base model as a state dict at ``path``, for a ``BaseModelSpec(path=...)`` to load.

    Imports torch and builds the model (the HTTP side of the service needs neither).
    """
    from rota_tinker._worker.models import save_base as write

    write(spec, path)


def __getattr__(name: str) -> object:
    """``TinkerService`` is imported on first use: it brings torch and the tinker SDK, which ``rota --help``
    and every other command that loads this plugin's CLI must not pay for."""
    if name == "TinkerService":
        from rota_tinker._http.service import TinkerService

        return TinkerService
    raise AttributeError(f"module 'rota_tinker' has no attribute {name!r}")
