"""A job's first park imports nothing heavy: looking for FSDP2 modules before a park used to import
``torch.distributed.fsdp``, 0.5-0.8 s of the first park on a CPU and 2.9-3.7 s on an H200 host. A job with an
optimizer has imported it already (torch's optimizers import torch._dynamo, which imports it); a model tracked
without one, such as an RL job's frozen reference policy or bench/switch.py's tenants, paid it at its first park."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import json, sys
    import rota, rota_fsdp
    import torch
    from fsdp_testlib import batch, make_model
    gpu = rota.connect(group="g", tenant="first-park", endpoint=sys.argv[1])
    model = make_model().eval().requires_grad_(False)  # a frozen reference policy: no optimizer
    tracked = rota_fsdp.track(gpu, model)
    with gpu.turn(), torch.no_grad():
        model(batch(0)[0])
    before = "torch.distributed.fsdp" in sys.modules
    gpu.park()
    parked = tracked.parker.device_bytes()
    with gpu.turn(), torch.no_grad():
        model(batch(1)[0])
    print(json.dumps({"before": before, "after": "torch.distributed.fsdp" in sys.modules, "parked": parked}))
    tracked.untrack()
    gpu.close()
""")


def test_the_first_park_of_a_model_without_an_optimizer_imports_no_fsdp(endpoint: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", SCRIPT, endpoint], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["parked"]["weights"] == 0 and not any(seen["parked"].values())  # it really parked
    assert not seen["before"] and not seen["after"], "a park of a plain model imported torch.distributed.fsdp"
