"""Entry point of rota-adapter-megatron in the ``rota`` group.

As for every torch adapter, the hooks are per tenant: :func:`rota_megatron.track`
registers one plugin object per tracked model on that tenant's plugin manager. This
module is what the entry point loads, so ``rota plugins`` lists the adapter and its
version even before anything is tracked; it implements no hook itself and imports
nothing heavy.
"""

from __future__ import annotations
