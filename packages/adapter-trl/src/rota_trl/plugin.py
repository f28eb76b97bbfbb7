"""rota plugin of rota-adapter-trl: listed by ``rota plugins``; a TRL version check when loaded.

Registered under the ``rota`` entry-point group. Loading it imports neither TRL nor transformers: an installed
TRL outside the supported range is logged once with the ``pip install`` that fixes it, and
:class:`rota_trl.RotaCallback` refuses it when training starts. The callback's hooks are per tenant (the
``rota_fsdp`` handles it tracks), so this module implements none itself.
"""

from __future__ import annotations

from rota_trl._compat import warn_on_load

warn_on_load()
