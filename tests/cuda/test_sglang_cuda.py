"""rota_sglang on a real GPU (issue 41, item 5): an in-process ``sglang.Engine`` (``enable_memory_saver=True``)
tracked with ``rota_sglang.track`` is parked whenever this process, a job of its own, asks for the device.

The engine runs in a process of its own (``sglang_engine.py`` run as a script) on a Qwen3-0.6B-shaped snapshot
built here (random bf16 weights and a small local tokenizer, ``save_pretrained``), with ``--attention-backend
triton`` (the staged sglang-kernel has FlashAttention 3 pruned). Between two of its turns this process acquires
the group, which parks the engine, and fills 60% of the device, which fits only if the park freed the engine's 50%.
Checked, with the weights kept on the host (``enable_weights_cpu_backup``) and dropped (pushed again with
``update_weights`` after each restore, as an RL loop does):

* while parked, NVML of the engine's processes is at most ``PARKED_MAX``;
* greedy completions after every restore equal those of the engine's first turn;
* no park or restore failed.

Needs SGLang (0.5.17 on the H200 host: bench/stage_wheels.py with bench/engines/sglang-0.5.17.toml) importable;
skipped otherwise, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="sglang is not importable here: stage sglang 0.5.17 on the GPU machine with "
                                     "bench/stage_wheels.py (bench/engines/sglang-0.5.17.toml), then run the tier")

from tests.cuda.park_probe import bare_context_mib, fill_fits, others_bytes, wait_for_count, write_count
from tests.cuda.sglang_engine import TURNS

pytestmark = pytest.mark.engines  # the tier's engines part (ROTA_TIER_PART=engines bash bench/cuda_tier.sh)

GB = 1 << 30
MIB = 1 << 20
FILL = 0.6  # of the device, filled by the other job in its turn: fits only beside a parked engine
PARKED_MAX = 2 * GB  # NVML bytes of all the engine's processes while parked (contexts, residue)
ENGINE = Path(__file__).with_name("sglang_engine.py")  # the engine's process, a script of its own


@pytest.mark.timeout(900)  # the engine's start-up and three turns
@pytest.mark.parametrize("backup", ["cpu", "none"], ids=["weights-kept", "weights-dropped"])
def test_an_sglang_engine_parks_for_another_job_and_answers_the_same(tmp_path: Path, qwen3_snapshot: Path,
                                                                     backup: str, record: Any) -> None:
    import torch

    import rota
    from rota.testing import running_orchestrator

    os.chmod(tmp_path, 0o700)
    out = tmp_path / "engine.json"
    group = f"sglang-{backup}"
    # the engine's log is written where the device tool brings files back ($OUT), as it runs: a run cut off by the
    # device budget or a hang still shows how far the engine got (one at 61be607 and one at b54a5f5 did not)
    log_path = Path(os.environ["OUT"], f"sglang-{backup}.log") if os.environ.get("OUT") else tmp_path / "engine.log"
    log = log_path.open("w")
    parked_each, filled = [], []  # per park: NVML bytes of each of the engine's processes (one reading)
    total = torch.cuda.get_device_properties(0).total_memory
    t0 = time.monotonic()
    with running_orchestrator() as (endpoint, _):
        env = os.environ | {"ROTA_ORCHESTRATOR": endpoint, "ROTA_GROUP": group, "ROTA_TENANT": "engine",
                            "PYTHONUNBUFFERED": "1", "ROTA_RESIDUE_MAX_BYTES": "0"}  # NVML is read here
        proc = subprocess.Popen([sys.executable, str(ENGINE), str(qwen3_snapshot), backup, str(out)], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        other = rota.connect(group=group, tenant="other", endpoint=endpoint)
        try:
            for turn in range(1, TURNS):
                wait_for_count(out.with_suffix(".engine"), turn, "the engine", 600, proc)
                other.acquire()  # the engine parks
                parked_each.append(others_bytes(os.getpid()))
                filled.append(fill_fits(int(total * FILL)))
                torch.cuda.empty_cache()
                other.release()
                write_count(out.with_suffix(".other"), turn)
            rc = proc.wait(600)
        except SystemExit as stop:  # the engine died or stalled before a turn: its log says why
            log.flush()
            raise AssertionError(f"{stop}:\n{log_path.read_text()[-4000:]}") from None
        finally:
            other.close()
            if proc.poll() is None:
                proc.kill()
            log.close()
    text = log_path.read_text()
    assert rc == 0, f"the engine's process exited {rc}:\n{text[-4000:]}"
    e = json.loads(out.read_text())
    parked = [sum(each) for each in parked_each]
    record(backup=backup, seconds=time.monotonic() - t0, parks=e["parks"], restores=e["restores"],
           park_s=e["park_s"], restore_s=e["restore_s"], parked_mib=[b // MIB for b in parked],
           parked_by_process_mib=[[b // MIB for b in each] for each in parked_each],
           bare_context_mib=bare_context_mib(),
           other_filled=filled, stale_at_turn=e["stale_at_turn"], dropped=e["dropped"], failures=e["failures"])
    assert not e["failures"], e["failures"]
    assert e["parks"] >= TURNS - 1 and e["restores"] >= TURNS - 1, e
    assert max(parked) <= PARKED_MAX, f"NVML of the parked engine's processes: {[b // MIB for b in parked]} MiB"
    assert all(filled), f"the other job could not fill {FILL:.0%} of the device beside the parked engine: {filled}"
    assert all(t == e["texts"][0] for t in e["texts"]), e["texts"]
    assert e["stale_at_turn"] == ([False] * TURNS if backup == "cpu" else [False] + [True] * (TURNS - 1))
