"""``python -m rota`` is the ``rota`` command."""

from rota.cli.main import main

main()
