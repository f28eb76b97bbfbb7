"""`rota demo`: three real training jobs share devices through rota, with bit-identical losses.

Two RL jobs and one SFT job, each a trainer and a sampler process (the shape of the
published experiment rota answers), run dedicated, serial and time-sliced. Needs torch
and matplotlib (``pip install 'rota-core[demo]'``); uses ``rota_fsdp`` to park state
when it is installed.
"""
