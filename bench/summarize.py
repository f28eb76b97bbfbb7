"""Print the README's "How fast is a switch" and two-GPU tables from the JSON in bench/results/.

    python bench/summarize.py            # markdown on stdout
"""

from __future__ import annotations

import json
import pathlib
import re

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _phase(point: dict) -> str:
    """What a failed tinker_density point was doing when its time ran out (its reason up to the tenants)."""
    reason = point.get("reason", "")
    return reason.split(":")[0].removeprefix("timed out while ") or "no reason recorded"


def _tinker_line(tinker: dict, name: str) -> None:
    """One line per tinker_density run: latency ratio, throughput and device memory of every point."""
    done = [p for p in tinker.get("points", []) if not p.get("failed")]
    points = ", ".join(f"N={p['tenants']} {p['latency_vs_alone']:.2f}x ({p['aggregate_steps_per_s']:.2f} steps/s, "
                       f"{p['device_mem_used_bytes'] / 1e9:.1f} GB)" for p in done)
    density = tinker.get("density_vs_one_tenant", tinker.get("density"))  # "density" is against t_ref since issue 44
    verdict = f"density {density}" if density is not None else "incomplete run"
    if tinker.get("density_vs_reference"):
        ref = tinker["density_vs_reference"]
        verdict += f"; density {ref['density']} against the peft reference's t_ref {ref['t_ref_s']:.3f} s"
    failed = [p for p in tinker.get("points", []) if p.get("failed")]
    if failed:
        points += "".join(f", N={p['tenants']} did not finish in --point-timeout-s ({_phase(p)})" for p in failed)
    base = tinker["points"][0]
    parks = "tenants resident between turns" if base.get("capacity_bytes") else "every switch parks"
    shared = tinker["args"].get("lora_concurrency", 1)
    if tinker["args"].get("lora_batch"):
        parks = "--lora-batch (every tenant's queued units in one batched pass)"
    elif shared > 1:
        parks = f"shared LoRA turns of {shared} (units of up to {shared} tenants at once in one rota turn)"
    print(f"Tinker service, LoRA tenants on one shared {base['base_bytes'] / 1e9:.1f} GB base, one H200, think "
          f"{tinker['think_s'] / base['median_step_s']:.1f}x the step, {tinker['args']['steps']} steps, {parks} "
          f"(step latency vs one tenant alone; tolerance {tinker['tolerance']}x): {points}; {verdict} ({name}).")


def _multigpu_rows() -> None:
    """One row per framework of bench/multigpu_switch.py: medians over ranks, residue, NCCL, bit-identity."""
    for path in sorted(RESULTS.glob("multigpu-*-cuda.json")):
        d = json.loads(path.read_text())
        ranks = d["ranks"]

        def worst(key: str, ranks: list = ranks) -> float:
            return max(r[key] for r in ranks)

        m = d["model"]
        what = (f"FSDP2 (fully_shard, fp32 AdamW), {d['ranks_per_job']} ranks" if d["framework"] == "fsdp2" else
                f"Megatron TP={m['tp']} DistributedOptimizer (bf16, fp32 main)")
        outside = max(r["residue_max_bytes"]["outside_allocator_nvml"] for r in ranks)
        context = max(r["nvml_context_bytes"] or 0 for r in ranks)
        print(f"| {what}, {d['jobs']} jobs x {d['turns_per_job']} turns, every switch parks both GPUs | "
              f"{ranks[0]['state_gb']:.2f} GB per rank | {worst('park_s_median'):.3f} s = "
              f"{worst('park_vs_floor'):.2f}x floor | {worst('restore_s_median'):.3f} s = "
              f"{worst('restore_vs_floor'):.2f}x floor | left on device per rank: "
              f"{max(r['residue_max_bytes']['allocator_allocated'] for r in ranks) / 2**20:.0f} MiB allocated; "
              f"NCCL + CUDA context {outside / 2**20:.0f} MiB (context {context / 2**20:.0f}); bit-identical "
              f"{d['all_bit_identical']}, hung: {d['hung'] or 'none'} | {path.name} |")


# A time-sliced-only run -> the run of the same configuration (and code) whose serial and dedicated runs it uses.
TIMESLICED_ONLY = {"demo-2gpu-20GB-park.json": "demo-2gpu-20GB-v1.json",
                   "demo-2gpu-60GB-timesliced.json": "demo-2gpu-60GB-swap.json"}


def _two_gpu_experiment() -> None:
    """The seed's experiment on two GPUs: GPU-hours of dedicated, serial and time-sliced, one line per run."""
    runs = sorted(RESULTS.glob("demo-2gpu-*.json"))
    if not runs:
        return
    print("| run (2 x H200, 3 jobs) | dedicated: GPUs, makespan, GPU-h | serial | time-sliced | "
          "time-sliced / serial makespan | GPU-h vs dedicated | trainer GPU busy | bit-identical | source |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in runs:
        d = json.loads(path.read_text())
        ref = d if "serial" in d else _load(TIMESLICED_ONLY[path.name])
        ts, ser, ded = d["timesliced"], ref["serial"], ref["dedicated"]
        gb = d["config"]["trainer_state_bytes"] / 1e9
        cap = ts["capacity_bytes"]
        policy = ts["how"].rsplit("(", 1)[-1].removesuffix(")")  # e.g. "priority+resident-first policy"
        sft_turns = d["config"].get("sft_turns", 1)  # runs before --sft-turns took one turn per SFT step
        room = f"--capacity {cap / 1e9:.0f}GB" if cap else "no capacity: every switch parks"
        how = f"{d['config']['steps']} steps, {gb:.1f} GB trainers, SFT step in {sft_turns} turn(s), {room}, {policy}"
        if "curves" in ref:
            curves = ref["curves"]["dedicated"]
            same: object = all(curves[k] == v for k, v in d["curves"]["timesliced"].items())
        else:  # an early run recorded only the verdict
            same = all(t["bit_identical"] for t in d["tenants"])

        def cell(m: dict) -> str:
            return f"{m['devices']}, {m['makespan_s']:.1f} s, {m['gpu_hours']:.4f}"

        print(f"| {how} | {cell(ded)} | {cell(ser)} | {cell(ts)} | {ts['makespan_s'] / ser['makespan_s']:.2f} | "
              f"{ts['gpu_hours'] / ded['gpu_hours']:.2f} | {ts['trainer_device_busy']:.0%} (serial "
              f"{ser['trainer_device_busy']:.0%}) | {same} | {path.name} |")


def _demo_logs() -> None:
    """``rota demo --device cuda`` runs kept as their printed summary (demo-cuda-*-default-auto.log)."""
    for path in sorted(RESULTS.glob("demo-cuda-*-default-auto.log"), key=lambda p: int(p.name.split("-")[2][:-2])):
        text = path.read_text()
        size = path.name.split("-")[2]
        ratio = re.search(r"time-sliced makespan / serial makespan = ([0-9.]+)", text)
        sw = re.search(r"switches (\d+), parks (\d+)", text)
        failed = re.search(r"failed parks (\d+), failed restores (\d+)", text)
        ident = re.findall(r"^\S+\s+[0-9.]+s\s+[0-9.]+s\s+[0-9.]+s\s+[0-9.]+x\s+(True|False)$", text, re.M)
        if not (ratio and sw and failed and ident):
            print(f"({path.name}: not a complete demo summary)")
            continue
        print(f"`rota demo --device cuda --state {size}` with its defaults (2 groups, `--capacity auto`) on one H200: "
              f"time-sliced makespan ÷ serial = {float(ratio[1]):.2f}, {sw[1]} switches, {sw[2]} parks, "
              f"{failed[1]} failed parks / {failed[2]} failed restores, bit-identical: "
              f"{all(x == 'True' for x in ident)} ({path.name}).")


def _reference_lines() -> None:
    """tinker_density runs measured against the peft reference (issue 44's form): t_ref, then per N the p50/p90
    step over t_ref, tokens/s, MFU and device memory."""
    for path in sorted(RESULTS.glob("tinker-density-*-batch-*.json")):
        run = json.loads(path.read_text())
        ref = run.get("reference")
        if not ref or not run.get("points"):
            continue
        gib = 1 << 30
        points = ", ".join(
            f"N={p['tenants']} p50 {p['p50_vs_ref']:.2f}x (p90 {p['p90_vs_ref']:.2f}x), "
            f"{p['aggregate_tokens_per_s'] / 1e3:.1f}k tokens/s, MFU {p['mfu']:.1%}, "
            f"{p['device_mem_used_bytes'] / gib:.1f} GiB" for p in run["points"] if not p.get("failed"))
        left = "" if run.get("complete") else "; the run was cut off after these points"
        within = [p["tenants"] for p in run["points"] if p.get("within_tolerance_of_ref")]
        density = run.get("density") if run.get("complete") else max(within, default=None)
        print(f"Tinker `--lora-batch` against a dedicated peft trainer, {run['args']['model']}, rank "
              f"{run['args']['rank']}, {run['args']['batch']} x {run['args']['seq_len']} tokens, on "
              f"{run['device_peak']['device_name']}: t_ref p50 {ref['t_ref_s']['p50'] * 1e3:.0f} ms "
              f"({ref['tokens_per_s'] / 1e3:.1f}k tokens/s, MFU {ref['mfu']:.1%}); {points}; density (p50 <= "
              f"{run['tolerance']}x t_ref) {density if density is not None else 'not reached'}{left} ({path.name}).")


def _tier_runs() -> list[tuple[str, dict]]:
    """Every CUDA tier JSON, oldest first (by its name's date): (its name, the tier)."""
    paths = sorted(RESULTS.glob("cuda-tier-2*.json"), key=lambda p: p.name.split("-")[2])
    return [(path.name, json.loads(path.read_text())) for path in paths]


def _newest_tiers_with(test_file: str) -> list[tuple[dict, str, list[tuple[str, dict]]]]:
    """Per GPU model, the newest CUDA tier JSON (by its name's date) of those that ran the most tests of
    ``test_file`` (a later rerun of one case does not hide a whole run): the tier, its name and those tests."""
    newest: dict[str, tuple[dict, str, list[tuple[str, dict]]]] = {}
    for name, tier in _tier_runs():
        mine = [(nodeid, t) for nodeid, t in tier.get("tests", {}).items() if test_file in nodeid]
        if mine and len(mine) >= len(newest.get(tier["device"], ({}, "", []))[2]):
            newest[tier["device"]] = (tier, name, mine)
    return list(newest.values())


def _demo_tier() -> None:
    """``rota demo --device cuda`` in the newest CUDA tier that ran it on each GPU model (test_demo_cuda.py)."""
    for tier, name, tests in _newest_tiers_with("test_demo_cuda.py"):
        _demo_tier_line(tier, name, tests)


def _demo_tier_line(tier: dict, name: str, tests: list[tuple[str, dict]]) -> None:
    """One tier run's demo tests, in one line."""
    parts = []
    for nodeid, t in tests:
        if t.get("outcome") != "passed" or "timesliced_over_serial" not in t:
            parts.append(f"{nodeid.split('::')[-1]} {t.get('outcome')}")
            continue
        case = nodeid.split("[")[-1].rstrip("]") if "[" in nodeid else "defaults"
        what = (f"--state {case.split('-')[0]} --groups {case.split('-')[1]} --capacity 0" if case != "defaults"
                else "--state 4GB --groups 1, default capacity")
        parts.append(f"{what}: time-sliced/serial {t['timesliced_over_serial']:.2f}, {t['parks']} parks"
                     + (f" (p50 {t['park_ms_p50']:.0f} ms, restore p50 {t['restore_ms_p50']:.0f} ms)"
                        if t["parks"] else "")
                     + f", {t['failed_parks']} failed" + (f" / {t['failed_restores']} failed restores"
                                                          if "failed_restores" in t else "")
                     + (f", bit-identical {all(t['bit_identical'])}" if "bit_identical" in t else ""))
    if parts:
        print(f"`rota demo --device cuda` in the CUDA tier on {tier['device']} at {tier['commit'][:10]} "
              f"({tier['date'][:10]}), three jobs of six workers (bit-identical: every curve equal to its dedicated "
              f"run): {'; '.join(parts)} ({name}).")


def _newest_tests(test_file: str) -> dict[str, dict[str, tuple[dict, str, dict]]]:
    """Per GPU model, each test of ``test_file`` as the newest CUDA tier JSON that ran it left it: nodeid ->
    (the tier, its name, the test)."""
    newest: dict[str, dict[str, tuple[dict, str, dict]]] = {}
    for name, tier in _tier_runs():
        for nodeid, t in tier.get("tests", {}).items():
            if test_file in nodeid:
                newest.setdefault(tier["device"], {})[nodeid] = (tier, name, t)
    return newest


def _sglang_tier() -> None:
    """SGLang under rota on each GPU model (in-process and served): each test as its newest CUDA tier run left it."""
    for device, tests in _newest_tests("tests/cuda/test_sglang").items():
        runs: dict[str, list[str]] = {}  # tier JSON -> its parts
        for nodeid, (_, name, t) in tests.items():
            case = nodeid.split("[")[-1].rstrip("]")
            how = "served" if "server" in nodeid else "in-process"
            if t.get("outcome") != "passed":
                part = f"{how} {case} {t.get('outcome')} (parked: {t.get('parked_mib')} MiB)"
            else:
                times = (f", park {', '.join(f'{x:.2f}' for x in t['park_s'])} s, restore "
                         f"{', '.join(f'{x:.2f}' for x in t['restore_s'])} s" if "park_s" in t else "")
                part = f"{how} {case}: parked {max(t['parked_mib'])} MiB in NVML{times}"
            runs.setdefault(name, []).append(part)
        commits = {name: tier["commit"][:10] for tier, name, _ in tests.values()}
        print(f"SGLang engine under rota (the staged release), CUDA tier on {device}: "
              + "; ".join(f"{'; '.join(runs[name])} at {commits[name]} ({name})"
                          for name in sorted(runs, key=lambda n: n.split("-")[2]))
              + "; greedy completions equal after every restore where passed.")


def _agent_tier() -> None:
    """The agent's whole-process backend in the newest CUDA tier that ran it on each GPU model."""
    for tier, name, tests in _newest_tiers_with("test_agent_whole_process_cuda.py"):
        _agent_tier_line(tier, name, tests)


def _agent_tier_line(tier: dict, name: str, tests: list[tuple[str, dict]]) -> None:
    """One tier run's whole-process tests, in one line."""
    parts = []
    for nodeid, t in tests:
        if t.get("outcome") != "passed":
            parts.append(f"{nodeid.split('::')[-1]} {t.get('outcome')}")
        elif "cycles" in t:
            c = t["cycles"]
            parks = ", ".join(f"{x['park_s']:.2f}" for x in c)
            restores = ", ".join(f"{x['restore_s']:.2f}" for x in c)
            parts.append(f"one {t['size_bytes'] / 1e9:.0f} GB process: park {parks} s, restore {restores} s, "
                         "NVML of the pid "
                         f"{c[0]['nvml_before'][str(c[0]['pids'][0])] / 1e9:.2f} GB -> "
                         f"{max(v for x in c for v in x['nvml_after'].values()) / 1e9:.0f}")
        elif "parallel" in t:
            parts.append(f"{len(t['pids'])} processes of {t['size_bytes'] / len(t['pids']) / 1e9:.0f} GB, parallel "
                         f"{t['parallel']}: park {t['park_s']:.2f} s, restore {t['restore_s']:.2f} s")
    print(f"Agent whole-process backend (CUDA checkpoint), CUDA tier on {tier['device']} at {tier['commit'][:10]}: "
          f"{'; '.join(parts)}; every byte checked ({name}).")


def _vllm_rows() -> None:
    """vLLM engines: rota's park/restore vs vLLM's own level-1 sleep, vs the pinned floor, one line per shape of
    each vllm-switch-cuda*.json (the card each ran on named)."""
    def x(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}x"
    for path in sorted(RESULTS.glob("vllm-switch-cuda*.json")):
        d = json.loads(path.read_text())
        card = d.get("device", "GPU").replace("NVIDIA ", "")
        for r in d["rows"]:
            o, v = r["rota"], r["vllm_level1"]
            print(f"vLLM {d['vllm']} engine, Qwen3-{r['shape']} shape ({r['weights_bytes'] / 1e9:.2f} GB of weights), "
                  f"one {card}{' at ' + d['commit'][:7] if d.get('commit') else ''}: rota park {x(o['park_x_floor'])} "
                  f"/ restore {x(o['restore_x_floor'])} the pinned floor (first park {x(o['first_park_x_floor'])}); "
                  f"vLLM's level-1 sleep {x(v['sleep_x_floor'])} / wake {x(v['wake_x_floor'])} (first sleep "
                  f"{x(v['first_sleep_x_floor'])}); failures {len(d['failures'])} ({path.name}).")


def _failed_tests(tier: dict) -> list[str]:
    """The names of a tier run's failed tests."""
    return [nodeid.split("::")[-1] for nodeid, t in tier["tests"].items() if t["outcome"] == "failed"]


def _tier_part(name: str) -> str:
    """One part of the tier (ROTA_TIER_TESTS): where and at what commit it ran, and its outcomes."""
    tier = _load(name)
    outcomes = [t["outcome"] for t in tier["tests"].values()]
    failed = _failed_tests(tier)
    files = sorted({nodeid.split("::")[0].rsplit("/", 1)[-1] for nodeid in tier["tests"]})
    if tier.get("part") in ("core", "engines"):  # bench/cuda_tier.sh's parts name themselves
        files = [f"the {tier['part']} part ({len(files)} files)"]
    return (f"{', '.join(files)} on {tier['device']} at {tier['commit'][:7]}: {outcomes.count('passed')} of "
            f"{len(outcomes)} passed" + (f", {outcomes.count('skipped')} skipped" if "skipped" in outcomes else "")
            + (f" (failed: {', '.join(failed)})" if failed else "") + _took(tier)
            + ("; cut off before its end (the tests after these did not run)" if tier.get("complete") is False else "")
            + f" ({name})")


def _took(tier: dict) -> str:
    """How long a tier run took, where its JSON says (the tier's target: 10 minutes on one GPU)."""
    return f"; {tier['seconds']:.0f} s in all" if tier.get("seconds") else ""


def _newest_whole_process() -> set[pathlib.Path]:
    """Per GPU model, the agent JSON whose whole-process rows are shown: the newest by the date in its name (a
    name without one is older: agent-cuda.json is from before pids had to be proven)."""
    newest: dict[str, tuple[str, pathlib.Path]] = {}
    for path in RESULTS.glob("agent-cuda*.json"):
        d = json.loads(path.read_text())
        if not d.get("whole_process_cuda"):
            continue
        stamp = max(re.findall(r"\d{8}", path.name), default="")
        gpu = d.get("gpu", "")
        if gpu not in newest or stamp > newest[gpu][0]:
            newest[gpu] = (stamp, path)
    return {path for _, path in newest.values()}


def _whole_tiers() -> None:
    """Per GPU model, its run of the whole tier (not one of bench/cuda_tier.sh's parts, then the one with the most
    tests, then the newest: a run of ROTA_TIER_TESTS or -k has fewer) and the parts of the tier run on that model
    since."""
    tiers = {path.name: _load(path.name) for path in sorted(RESULTS.glob("cuda-tier-*.json"))}
    by_card: dict[str, list[str]] = {}
    for name, tier in tiers.items():
        by_card.setdefault(tier["device"], []).append(name)
    for names in by_card.values():
        whole = max(names, key=lambda n: (not tiers[n].get("part"), len(tiers[n]["tests"]), n))
        tier = tiers[whole]
        outcomes = [t["outcome"] for t in tier["tests"].values()]
        parks = [p for t in tier["tests"].values() if isinstance(t.get("parks"), list)  # the demo's are counts
                 for p in t["parks"] if "parked_nvml_after" in p]
        beyond = max((p["parked_nvml_after"] - p["parked_outside_allocator"] for p in parks), default=0)
        failed = _failed_tests(tier)
        print(f"CUDA tier on {tier['device']} at {tier['commit'][:10]} ({tier['date'][:10]}): "
              f"{outcomes.count('passed')} of {len(outcomes)} passed"
              + (f" ({outcomes.count('skipped')} skipped: two-GPU tests on one GPU)" if "skipped" in outcomes else "")
              + (f"; failed: {', '.join(failed)}" if failed else "")
              + (f"; Tinker workers' parks: {len(parks)}, the most any left beside its CUDA context "
                 f"{beyond / 2**20:.0f} MiB" if parks else "") + _took(tier) + f" ({whole}).")
        later = sorted(n for n in names if n > whole and re.match(r"cuda-tier-\d{8}T", n))  # run since
        if later:
            print("Parts of the CUDA tier run since on this card: " + "; ".join(_tier_part(n) for n in later) + ".")


def main() -> None:
    print("| path (H200, bf16, 800 tensors) | size | park | restore | overlapped park ‖ restore | source |")
    print("|---|---|---|---|---|---|")
    for name, label in (("switch-cuda.json", "adapter, memory returned to driver (default)"),
                        ("switch-cuda-20GB.json", "adapter, memory returned to driver, a restore taking one block"),
                        ("switch-cuda-keepcache.json", "adapter, memory kept in torch's cache")):
        d = _load(name)
        for r in (d or {}).get("results", []):
            print(f"| {label} | {r['size_bytes'] / 1e9:.0f} GB | {r['park_s']:.3f} s = {r['park_ratio']:.2f}x floor "
                  f"| {r['restore_s']:.3f} s = {r['restore_ratio']:.2f}x floor | {r['overlap_gbps']:.0f} GB/s "
                  f"(bare copy {r['floor_overlap_gbps']:.0f}) | {name} |")
    region_only = RESULTS / "agent-cuda-region.json"  # a later region-only run supersedes the combined one's
    whole_from = _newest_whole_process()
    for path in sorted(RESULTS.glob("agent-cuda*.json"), reverse=True):
        name, d = path.name, json.loads(path.read_text())
        if path != region_only and region_only.exists():
            d = {**d, "region_app_channel": []}
        gpu = d.get("gpu", "")
        for w in d.get("whole_process_cuda", []) if path in whole_from else []:
            on = "" if "H200" in gpu else f" on {gpu.replace('NVIDIA ', '')}"
            procs = f", {w['procs']} processes of the job, parallel {w['parallel']}" if w.get("procs", 1) > 1 else ""
            print(f"| agent, whole-process (CUDA checkpoint){on}{procs} | {w['size_bytes'] / 1e9:.0f} GB | "
                  f"{w['park_s']:.2f} s ({w['park_GBps']:.1f} GB/s) | {w['restore_s']:.2f} s ({w['restore_GBps']:.1f} "
                  f"GB/s) | - | {name} |")
        for r in d.get("region_app_channel", []):
            best = min(r["switches"])
            print(f"| agent, region app_channel, release→grant end to end | {r['size_bytes'] / 1e9:.0f} GB | - | - | "
                  f"best {best:.2f} s = {best / r['floor_switch_s']:.2f}x overlapped floor "
                  f"(median {r['ratio_vs_floor']:.2f}x) | {name} |")
    mega = _load("megatron-cuda.json")
    if mega:
        print(f"| Megatron DDP + DistributedOptimizer GPT, every step | {mega['state_bytes'] / 1e9:.1f} GB | "
              f"{mega['park_s_median']:.3f} s = {mega['park_vs_floor']:.2f}x floor | {mega['restore_s_median']:.3f} s "
              f"= {mega['restore_vs_floor']:.2f}x floor | - | megatron-cuda.json |")
    _multigpu_rows()
    print()
    _two_gpu_experiment()
    print()
    _demo_logs()
    for path in sorted(RESULTS.glob("demo-cuda-*.json")):
        demo, size = json.loads(path.read_text()), path.stem.removeprefix("demo-cuda-")
        ts = demo["timesliced"]
        print(f"`rota demo --device cuda --state {size} --groups 1` (every switch parking), before the park race "
              "was fixed (such runs also failed parks while exiting 0): time-sliced makespan ÷ serial = "
              f"{demo['ratios']['timesliced_over_serial_makespan']:.2f}, busy {ts['busy_fraction']:.0%}, "
              f"{ts['switches']} switches, park p50 {ts['park_ms_p50']:.0f} ms / restore p50 "
              f"{ts['restore_ms_p50']:.0f} ms, {ts['bytes_moved'] / 2**30:.0f} GiB moved, bit-identical: "
              f"{all(t['bit_identical'] for t in demo['tenants'])} ({path.name}).")
    _demo_tier()
    _agent_tier()
    _vllm_rows()
    _sglang_tier()
    verify = _load("verify-cuda.json")
    if verify:
        costs = ", ".join(f"{size}: sample {m['sample']['extra_fraction_of_switch']:.1%}, full "
                          f"{m['full']['extra_fraction_of_switch']:.1%}" for size, m in verify["verify"].items())
        print(f"Cost of `--verify` as a fraction of switch time (extra over `off`): {costs} (verify-cuda.json).")
    for name in ("tinker-density-h200-qwen3-1.7b-batch-micro8192.json",  # bench/tinker_h200.sh batch, once run
                 "tinker-density-h200-qwen3-1.7b-batch-vs-shared.json",  # ... compare
                 "tinker-density-h200-qwen3-1.7b-batch-kernels.json", "tinker-density-h200-qwen3-1.7b-batch.json",
                 "tinker-density-h200-qwen3-1.7b-shared.json",
                 "tinker-density-h200-qwen3-1.7b-pool.json",  # shared turns, written when they were called a pool
                 "tinker-density-h200-qwen3-1.7b-pool-repeat.json",
                 "tinker-density-h200-qwen3-1.7b-pool-fp32-lora.json",
                 "tinker-density-h200-qwen3-1.7b.json", "tinker-density-h200-qwen3-1.7b-n8.json",
                 "tinker-density-h200.json", "tinker-density-h200-r8.json", "tinker-density-h200-r4-8steps.json",
                 "tinker-density-h200-park-every-switch.json"):
        tinker = _load(name)
        if tinker:
            _tinker_line(tinker, name)
    _reference_lines()
    amp = _load("lora-step-amp-h200.json")
    if amp:
        rows = {r["variant"]: r for r in amp["results"]}
        mine, peft = rows["one_loss"], rows["fp32_lora"]
        print(f"One LoRA forward_backward (Qwen3-1.7B shape, bf16 base, rank 16, 8 x 256 tokens, one H200, one run): "
              f"LoRA in the base's bf16 {mine['median_s'] * 1e3:.0f} ms ({mine['device_busy_s'] * 1e3:.0f} ms of "
              f"kernels), peft's fp32 LoRA path {peft['median_s'] * 1e3:.0f} ms ({peft['device_busy_s'] * 1e3:.0f} ms) "
              "(lora-step-amp-h200.json).")
    for name, how in (("tinker-full-turns-h200-hf.json", "snapshots loaded with from_pretrained"),
                      ("tinker-full-turns-h200.json", "config-only snapshots random-initialised by the service")):
        full = _load(name)
        if not full:
            continue
        rows = ", ".join(f"{t['base_model'].split('/')[-1]} park {sw['park_vs_floor']:.2f}x / restore "
                         f"{sw['restore_vs_floor']:.2f}x of {sw['park_bytes'] / 1e9:.1f} GB"
                         for t, sw in ((full["tenants"][k], full["switches"][k]) for k in full["tenants"]))
        print(f"Tinker service, full-parameter tenants taking turns on one H200 ({how}; every switch parks; vs the "
              f"pinned floor): {rows}; bit-identical to each alone: {full['all_bit_identical']} ({name}).")
    _whole_tiers()
    for name, label in (("handoff-cpu.json", "embedded"), ("handoff-etcd-cpu.json", "through etcd")):
        d = _load(name)
        if d:
            print(f"Handoff with state resident, {label} (2-core CPU): p50 {d['p50_ms']:.2f} ms, "
                  f"p99 {d['p99_ms']:.2f} ms ({name}).")


if __name__ == "__main__":
    main()
