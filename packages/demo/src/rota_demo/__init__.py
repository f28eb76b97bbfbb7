"""rota_demo: ``rota demo``, three real training jobs sharing devices through rota, with bit-identical losses.

Two RL jobs and one SFT job, each a trainer and a sampler process (the shape of the
published experiment rota answers), run dedicated, serial and time-sliced; the
time-sliced trainers park their state with ``rota_fsdp``. Installs torch and
matplotlib (``pip install rota-demo``). :mod:`rota_demo.plugin` adds the command to
the ``rota`` CLI; :mod:`rota_demo.cli` is the command, :mod:`rota_demo.runner` runs it.
"""
