"""rota plugin of rota-adapter-verl: listed by ``rota plugins``; it imports no verl.

verl loads the plugin proper itself, from the ``verl.plugins`` entry point (:mod:`rota_verl.verl_plugin`), on
``import verl`` in every process of a verl job. This module implements no hook: the trainer's tenant is a
plain ``rota.connect()`` client.
"""

from __future__ import annotations
