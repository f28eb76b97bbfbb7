"""The worker processes: a tenant's trainer and sampler (:mod:`.main`), the base holder (:mod:`.holder`),
the batched LoRA worker (:mod:`.batch`) and the shared LoRA turn (:mod:`.shared_turn`), with the models, sampling and
checkpoint files they share. Each runs in a process the HTTP process spawned
(:mod:`rota_tinker._http.server.handles`)."""
