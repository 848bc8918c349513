"""The shape of the cpuservice package: modules and their lines, the largest, the import graph's
cycles (every import counts, also those only for type checking), and each module's floor (the
longest chain of imports below it). Pure reading of the sources (ast), nothing imported.

    python3 scripts/architecture.py [--max-lines N] [--json]

Exit 1 when there is a cycle or a module over --max-lines (default: no limit), so a test can
hold the line.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Mapping
from pathlib import Path

PACKAGE = "cpuservice"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (relative or absolute, any depth)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                found.add(target)
    return found


# The layers, lowest first: a module may import its own layer and the ones before it. The
# package's top-level modules (the daemon's composition root, __main__, entry points kept at
# earlier paths) may import anything.
LAYERS = ("model", "placement", "apply", "host", "shell", "bus", "cli")


def layer(name: str) -> int | None:
    """The layer of a module: -1 for the package itself (its version), None for the top-level
    modules."""
    parts = name.split(".")
    if len(parts) == 1:
        return -1
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def upward(graph: Mapping[str, set[str]]) -> list[str]:
    """Imports that point up the layers (or into a layer from the top-level modules' side)."""
    out = []
    for v, targets in sorted(graph.items()):
        here = layer(v)
        for w in sorted(targets):
            there = layer(w)
            if here is not None and (there is None or there > here):
                out.append(f"{v} -> {w}")
    return out


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def floors(graph: Mapping[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 0 for a module importing nothing of the package, else one more than
    its highest import (a module in a cycle counts the cycle once)."""
    memo: dict[str, int] = {}

    def floor(v: str, seen: frozenset[str]) -> int:
        if v in memo:
            return memo[v]
        below = [floor(w, seen | {v}) for w in graph[v] if w not in seen | {v}]
        memo[v] = 1 + max(below) if below else 0
        return memo[v]

    return {v: floor(v, frozenset()) for v in sorted(graph)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-lines", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    lines = {name: len(path.read_text().splitlines()) for name, path in known.items()}
    found = cycles(graph)
    levels = floors(graph)
    largest = max(lines, key=lambda n: lines[n])
    over = sorted(n for n in lines if args.max_lines and lines[n] > args.max_lines)
    wrong = upward(graph)
    if args.json:
        print(json.dumps({"modules": len(known), "largest": [largest, lines[largest]],
                          "cycles": found, "floors": max(levels.values()) + 1,
                          "upward_imports": wrong,
                          "over": over}, indent=1))
    else:
        print(f"modules {len(known)}")
        print(f"largest {largest} {lines[largest]}")
        print(f"floors {max(levels.values()) + 1}")
        print(f"cycles {len(found)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found))
        print(f"upward_imports {len(wrong)}" + "".join(f"\n  {w}" for w in wrong))
        if args.max_lines:
            print(f"over_{args.max_lines}_lines {len(over)}"
                  + "".join(f"\n  {n} {lines[n]}" for n in over))
    return 1 if found or over or wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
