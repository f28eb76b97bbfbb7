"""rota_tinker's module tree stays clear: no import cycles (counting imports inside functions, which is how a worker
module once reached back into the module that imported it) and no module much past 600 lines."""

from __future__ import annotations

from pathlib import Path

import grimp

import rota_tinker

MAX_LINES = 640  # "under ~600 lines" with a little room for a docstring


def test_rota_tinker_has_no_import_cycle() -> None:
    graph = grimp.build_graph("rota_tinker")
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i.startswith("rota_tinker")}
             for m in graph.modules}
    cycles: list[list[str]] = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(edges[node]):
            if nxt == start:
                cycles.append([*path, start])
            elif nxt not in path and nxt > start:  # each cycle found once, from its smallest module
                walk(start, nxt, [*path, nxt])

    for module in sorted(edges):
        walk(module, module, [module])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles[:5])


def test_no_module_is_much_past_600_lines() -> None:
    root = Path(rota_tinker.__file__).parent
    lines = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not long, long
