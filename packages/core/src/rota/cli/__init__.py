"""The ``rota`` command line: thin click commands over library functions.

Two modules are public, for plugins' own commands: :mod:`rota.cli.options` (click option types)
and :mod:`rota.cli.status` (how a status reply is printed). The commands themselves
(``main``, ``orchestrator``, ``plugins``, ``token``) are core's; plugins add theirs through the
``rota_cli`` hook.
"""
