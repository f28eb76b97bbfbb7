"""pyproject's import-linter contracts, for what import-linter cannot see: tests and benchmarks.

import-linter checks importable packages; tests/, packages/*/tests and bench/ are folders of scripts
and test modules, so this applies the same rules to them, read from the contracts in pyproject.toml:

* private modules: a module whose name has a part starting with ``_`` (``rota._orchestrator.turns``,
  ``rota_etcd._store``) is imported only by its own package, which here means the tests of the
  distribution that ships it (``packages/orchestrator-etcd/tests`` may import ``rota_etcd._store``).
  Everything else uses public modules (``rota.wire``, not ``rota._generated``);
* layers: a package's tests import what the package may import (its own layer's other packages and
  the layers above it never); tests/ and bench/ sit above every layer;
* forbidden modules: a plugin's tests use of core's command line only what the plugin may
  (``rota.testing.cli_with_plugins`` gives the ``rota`` group); tests/ and bench/ likewise.

Except the imports in EXCEPTIONS, each with its reason.

Usage: python scripts/check_private_imports.py   (exit 1 naming each import that breaks a rule)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("tests", "bench", "packages/*/tests")

# (file, module) -> why it may import it (a private module, another layer's package or a forbidden module).
# Keep it short: a public seam is the better fix.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("bench/handoff.py", "rota._tenant"): "measures the embedded orchestrator's start-up (waits on is_serving)",
    ("bench/handoff.py", "rota._units"): "percentile, core's own, so the figures match rota status'",
    ("bench/scale.py", "rota._units"): "percentile, core's own, so the figures match rota status'",
    ("bench/scale.py", "rota_etcd._shards"): "places groups on the shards it measures",
    ("bench/scale_sim.py", "rota_etcd._shards"): "simulates etcd's shard assignment",
    ("bench/scale_sim.py", "rota_etcd._store"): "measures the size of the encoded group state",
    ("bench/lora_step_profile.py", "rota_tinker._worker"): "profiles the service's LoRA step itself",
    ("bench/multilora_step.py", "rota_tinker._worker"): "measures the batched LoRA step itself (no service)",
    ("bench/multilora_profile.py", "rota_tinker._worker"): "profiles the batched LoRA step itself (no service)",
    ("bench/logprobs_kernel.py", "rota_tinker._worker"): "measures the batched LoRA step's logprob kernels",
    ("bench/liger_kernels.py", "rota_tinker._worker"): "measures the batched LoRA step with liger-kernel's kernels",
    ("bench/tinker_density.py", "rota_tinker._worker"): "builds the service's tiny model",
    ("tests/cuda/test_multilora_cuda.py", "rota_tinker._worker"): "checks the batched LoRA kernels on a GPU",
    ("tests/security/test_ledger.py", "rota_torch._ledger"): "attacks the node host-memory ledger's files directly",
    ("tests/security/test_metrics.py", "rota._orchestrator"): "attacks the metrics collector (metrics.py) directly",
    ("tests/security/test_tinker_checkpoints.py", "rota_tinker._http"): "the checkpoint registry's bounds and a "
                                                                         "tenant's model record, attacked directly",
    ("tests/security/test_tinker_stability.py", "rota_tinker._http"): "the stability record store's bounds, "
                                                                       "attacked directly (millions of samples)",
    ("tests/security/test_tinker_shared_turn.py", "rota_tinker._worker"): "a shared LoRA turn's admission, attacked "
                                                                         "directly",
    ("packages/agent/tests/tenant_proc.py", "rota_fsdp"): "a tenant whose state the agent parks is a real trainer's",
    ("packages/core/tests/prefetch_tenant.py", "rota_agent"): "a prefetch is also asked of a node agent's tenant",
    ("packages/core/tests/prefetch_tenant.py", "rota_torch"): "a prefetch restores real tensors ahead of a grant",
    ("packages/core/tests/test_prefetch.py", "rota_agent"): "a prefetch is also asked of a node agent's tenant",
}

CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
# package -> its layer, 0 at the top (rota_demo | rota_tinker), from the layers contract
LAYER = {pkg.strip(): i for c in CONTRACTS if c["type"] == "layers" for i, layer in enumerate(c["layers"])
         for pkg in layer.split("|")}
# forbidden contracts: (source packages, forbidden modules)
FORBIDDEN = [({m.split(".")[0] for m in c["source_modules"]}, c["forbidden_modules"])
             for c in CONTRACTS if c["type"] == "forbidden"]
INDEPENDENT = [set(c["modules"]) for c in CONTRACTS if c["type"] == "independence"]


# import package -> its folder, for every package of this repository (packages/NAME/src/PACKAGE)
SOURCES = {p.name: p for p in ROOT.glob("packages/*/src/*") if p.is_dir() and p.name.isidentifier()}


def _own_packages(path: Path) -> set[str]:
    """The import packages a test file's distribution ships (packages/NAME/src/*), none for tests/ and bench/."""
    rel = path.relative_to(ROOT).parts
    if rel[0] != "packages":
        return set()
    return {name for name, src in SOURCES.items() if src.parent.parent.name == rel[1]}


def _is_module(name: str) -> bool:
    parts = name.split(".")
    where = SOURCES[parts[0]].joinpath(*parts[1:])
    return where.is_dir() or where.with_suffix(".py").is_file()


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of each import of this repository's modules (``from a import b``: b too, if a module)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, m) for line, m in out if m.split(".")[0] in SOURCES and _is_module(m)]


def _private(module: str) -> str | None:
    """The private module ``module`` is or is inside (``rota._generated.x`` -> ``rota._generated``), if any."""
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[: i + 1])
    return None


def _broken(module: str, own: set[str]) -> tuple[str, str] | None:
    """(the module or package named in the rule, the rule) that importing ``module`` from tests of ``own`` breaks."""
    private = _private(module)
    if private is not None and private.split(".")[0] not in own:
        return private, f"private to {private.split('.')[0]}; use its public modules"
    pkg = module.split(".")[0]
    if own and pkg not in own and pkg in LAYER and LAYER[pkg] <= min(LAYER[o] for o in own):
        return pkg, f"the layers contract keeps {', '.join(sorted(own))} from importing it"
    for modules in INDEPENDENT:
        if own & modules and pkg in modules - own:
            return pkg, f"{', '.join(sorted(own & modules))} and {pkg} are independent by pyproject's contracts"
    plugins = set(LAYER) - {"rota"}
    for source, forbidden in FORBIDDEN:  # tests/ and bench/: what every plugin may not
        sources = own or (plugins if plugins <= source else set())
        if sources & source and not own & {f.split(".")[0] for f in forbidden}:
            hit = next((f for f in forbidden if module == f or module.startswith(f + ".")), None)
            if hit is not None:
                whom = ", ".join(sorted(sources & source)) if own else "every plugin"
                return hit, f"forbidden to {whom} by pyproject's contracts"
    return None


def check() -> list[str]:
    problems, used = [], set()
    for pattern in CHECKED:
        for path in sorted(ROOT.glob(f"{pattern}/**/*.py")):
            rel = str(path.relative_to(ROOT))
            own = _own_packages(path)
            seen = set()
            for line, module in _imports(ast.parse(path.read_text(), rel)):
                broken = _broken(module, own)
                if broken is None:
                    continue
                name, why = broken
                if (rel, name) in EXCEPTIONS:
                    used.add((rel, name))
                elif (line, name) not in seen:
                    seen.add((line, name))
                    problems.append(f"{rel}:{line}: imports {name}, {why} (or add the import to EXCEPTIONS in "
                                    "this script, with why)")
    for rel, private in sorted(EXCEPTIONS.keys() - used):
        problems.append(f"{rel}: no longer imports {private}; remove it from EXCEPTIONS in this script")
    return problems


if __name__ == "__main__":
    found = check()
    print("\n".join(found) or "tests and bench keep the import contracts, but for the listed exceptions")
    sys.exit(1 if found else 0)
