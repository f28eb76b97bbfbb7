"""Entry point of rota-adapter-fsdp in the ``rota`` group.

The adapter's hooks are per tenant: :func:`rota_fsdp.track` registers one plugin
object per tracked model on that tenant's plugin manager. This module is what the
entry point loads, so ``rota plugins`` lists the adapter and its version even before
anything is tracked; it implements no hook itself.
"""

from __future__ import annotations
