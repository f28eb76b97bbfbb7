"""The HTTP process: the tinker API (routes, formats, quotas, checkpoints, signed URLs) and the handles of
its worker processes (:mod:`.handles`). It never imports torch at module level; the device work is done in
the worker processes (:mod:`rota_tinker._worker.main`)."""
