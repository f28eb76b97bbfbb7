"""LoRA tenants on one base share one resident copy of it, read-only, and still get their own exact numbers.

The proof is the kernel's view, not the service's word: each LoRA worker maps the
base holder's shared-memory file (same inode), holds none of it privately, and its
anonymous memory stays below a full-parameter worker's plus half a base; the base's
checksum is unchanged after training and sampling.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import tinker
from tinker import types
from tinker_testlib import WIDE, batch

from rota_tinker import TinkerService

STEPS = 3
TIMEOUT = 180
SEEDS = {"bob": 21, "carol": 22}


def lora_loop(sc: tinker.ServiceClient, seed: int, name: str) -> tuple[list[float], list[int]]:
    """A few LoRA steps on the wide base, then save for the sampler and sample: (losses, sampled tokens)."""
    tc = sc.create_lora_training_client(base_model=WIDE.name, rank=4, seed=seed).result(timeout=TIMEOUT)
    losses = []
    for step in range(STEPS):
        fb = tc.forward_backward(batch(step, seed=seed, vocab=WIDE.vocab), "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result(timeout=TIMEOUT).metrics["loss:sum"])
        op.result(timeout=TIMEOUT)
    path = tc.save_weights_for_sampler(name).result(timeout=TIMEOUT).path
    sampler = sc.create_sampling_client(model_path=path).result(timeout=TIMEOUT)
    res = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1,
                         types.SamplingParams(max_tokens=4, seed=7)).result(timeout=TIMEOUT)
    return losses, list(map(int, res.sequences[0].tokens))


def mapping(pid: int, inode: int) -> dict[str, int] | None:
    """Summed smaps fields (kB) of ``pid``'s mappings of the file with ``inode``; None if it maps none."""
    out: dict[str, int] = {}
    found = False
    with open(f"/proc/{pid}/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                inside = int(head[4]) == inode
                found |= inside
            elif inside and head[0].endswith(":") and len(head) == 3 and head[2] == "kB":
                out[head[0][:-1]] = out.get(head[0][:-1], 0) + int(head[1])
    return out if found else None


def rss_anon_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_lora_tenants_share_one_read_only_base(service: TinkerService,
                                               client: Callable[[str], tinker.ServiceClient]) -> None:
    ref = client("alice").create_lora_training_client(base_model="rota/tiny", rank=2).result(timeout=TIMEOUT)
    ref.forward_backward(batch(0, seed=1), "cross_entropy").result(timeout=TIMEOUT)  # a trainer with no big base

    results: dict[str, tuple[list[float], list[int]]] = {}
    errors: list[BaseException] = []

    def run(tenant: str) -> None:
        try:
            results[tenant] = lora_loop(client(tenant), SEEDS[tenant], "together")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in SEEDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors

    info = service.base_holder_info(WIDE.name, checksum=True)
    seg = info["segment"]
    assert info["bytes"] >= 75 * 2**20 and seg["path"].startswith("/dev/shm/")
    assert seg["end"] - seg["start"] >= info["bytes"]  # one segment holds the whole base
    base_kb = info["bytes"] // 1024
    ref_anon = rss_anon_kb(service.worker_pid("alice", "trainer"))  # type: ignore[arg-type]
    for tenant in SEEDS:
        for role in ("trainer", "sampler"):
            pid = service.worker_pid(tenant, role)
            assert pid is not None and pid != info["pid"]
            m = mapping(pid, seg["inode"])
            assert m is not None, f"{tenant}.{role} does not map the shared base {seg}"
            assert m["Rss"] > 0 and m["Private_Clean"] + m["Private_Dirty"] == 0, m  # read from it, never copied
            assert rss_anon_kb(pid) < ref_anon + base_kb // 2, (tenant, role, rss_anon_kb(pid), ref_anon, base_kb)
    assert info["unchanged"], "a tenant wrote into the shared base"

    assert results["bob"] != results["carol"]  # different seeds and data: different runs
    for tenant in SEEDS:  # and each equals its run alone, exactly
        assert lora_loop(client(tenant), SEEDS[tenant], "alone") == results[tenant]
    assert service.base_holder_info(WIDE.name, checksum=True)["unchanged"]
