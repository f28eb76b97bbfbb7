"""rota_tinker: a Tinker-API-compatible training and sampling service whose tenants take turns on GPUs.

Users keep their ``tinker`` SDK loops (``forward_backward``, ``optim_step``,
``save_weights_for_sampler``, ``sample``); each API key is a tenant with its own trainer
and sampler worker processes, and every work unit runs inside a rota turn, so several
tenants (full-parameter or LoRA) share devices without knowing it::

    from rota_tinker import ServiceConfig, Tenant, TinkerService
    cfg = ServiceConfig(tenants=(Tenant("alice", ALICE_KEY),), data_dir="/tmp/tinker")  # "tml-" + 128 random bits
    with TinkerService(cfg) as svc:      # TINKER_BASE_URL=svc.url
        ...

``rota tinker serve`` runs it from the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time each loads on first use, so
    # that loading the plugin (rota --help) imports none of them
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


_HOME = {
    "TinkerService": "rota_tinker._http.service",
    "DEFAULT_BASE_MODELS": "rota_tinker._config",
    "BaseModelSpec": "rota_tinker._config",
    "ServiceConfig": "rota_tinker._config",
    "Tenant": "rota_tinker._config",
    "parse_base_model": "rota_tinker._config",
    "parse_keys": "rota_tinker._config",
    "HfModelSpec": "rota_tinker._hf",
    "find_models": "rota_tinker._hf",
    "search_dirs": "rota_tinker._hf",
}
__getattr__ = lazy_getattr(__name__, _HOME)
