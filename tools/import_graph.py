"""Print the project's module graph from `ast` imports, and check its layering.

    python tools/import_graph.py              # edges between top-level areas, with counts
    python tools/import_graph.py --modules    # every module-to-module edge
    python tools/import_graph.py --check      # exit 1 if a layering rule is broken
    python tools/import_graph.py --sizes      # the largest shipped modules

An "area" is a package one level down (`marind.agent`, `marind.trainer`, `ckpt_store`,
`bench`, `chaos`, `tests`), or a top-level module of `marind` (`marind.core.spec`). Imports inside
functions count the same as module-level ones: a lazy import is still a dependency.
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("marind", "ckpt_store", "trainer", "bench", "chaos", "tests", "tools")
SHIPPED = ("marind", "ckpt_store", "trainer")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(target)
            found.extend(f"{target}.{alias.name}" for alias in node.names)
    return [name for name in found if name.split(".")[0] in TOP]


def area(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "marind" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def python_files() -> list[Path]:
    files = []
    for top in TOP:
        base = ROOT / top
        if base.is_dir():
            files.extend(p for p in base.rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(files)


def known_modules(files: list[Path]) -> set[str]:
    return {module_name(p) for p in files}


def resolve(name: str, modules: set[str]) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def edges(files: list[Path]) -> dict[tuple[str, str], int]:
    modules = known_modules(files)
    out: dict[tuple[str, str], int] = collections.Counter()
    for path in files:
        src = module_name(path)
        for target in {resolve(n, modules) for n in imports_of(path)}:
            if target and target != src:
                out[(src, target)] += 1
    return out


# Layering rules: (importer area prefix, imported area prefix, why it is forbidden).
RULES = [
    ("ckpt_store", "marind", "ckpt_store is a standalone library"),
    ("ckpt_store", "trainer", "ckpt_store is a standalone library"),
    ("marind.core", "marind.", "the core sits at the bottom"),
    ("marind.trainer", "marind.agent", "the trainer uses the public worker and checkpoint APIs only"),
    ("marind.trainer", "marind.commands", "the trainer uses the public worker and checkpoint APIs only"),
    ("marind.trainer", "marind.rendezvous", "the trainer uses the public worker and checkpoint APIs only"),
    ("marind.agent", "marind.trainer", "the agent runs any program, not the trainer's code"),
    ("marind.doctor_cluster", "marind.agent", "the cluster probe sits below the agent that starts it"),
    ("marind.worker", "marind.trainer", "the worker API serves any program; the trainer builds on it"),
    ("marind.worker", "marind.agent", "the worker API talks to its agent through files only"),
    ("marind.rendezvous", "marind.trainer", "the rendezvous knows nothing of the trainer"),
    ("marind.", "bench", "shipped code never imports benchmarks"),
    ("marind.", "chaos", "shipped code never imports chaos scripts"),
    ("bench", "tests", "bench imports shipped code, never tests"),
    ("chaos", "tests", "chaos imports shipped code, never tests"),
    ("marind", "tests", "shipped code never imports tests"),
    ("ckpt_store", "tests", "shipped code never imports tests"),
]


def violations(edge_map: dict[tuple[str, str], int]) -> list[str]:
    bad = []
    for (src, dst) in sorted(edge_map):
        for src_prefix, dst_prefix, why in RULES:
            src_ok = src == src_prefix.rstrip(".") or src.startswith(src_prefix if src_prefix.endswith(".") else src_prefix + ".") or src == src_prefix
            dst_ok = dst.startswith(dst_prefix) if dst_prefix.endswith(".") else (dst == dst_prefix or dst.startswith(dst_prefix + "."))
            if src_prefix == "marind.core" and dst.startswith("marind.core"):
                continue
            if src_ok and dst_ok:
                bad.append(f"{src} -> {dst}: {why}")
    return bad


def cycles(edge_map: dict[tuple[str, str], int]) -> list[str]:
    """Pairs of shipped areas that import each other (dependencies must run one way)."""
    pairs = {(area(a), area(b)) for (a, b) in edge_map
             if a.split(".")[0] in SHIPPED and b.split(".")[0] in SHIPPED and area(a) != area(b)}
    return [f"{a} <-> {b}: two areas import each other" for (a, b) in sorted(pairs) if a < b and (b, a) in pairs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="module-level edges")
    parser.add_argument("--check", action="store_true", help="exit 1 on a layering violation")
    parser.add_argument("--sizes", action="store_true", help="largest shipped modules")
    args = parser.parse_args(argv)
    files = python_files()
    edge_map = edges(files)
    if args.sizes:
        sizes = sorted(
            ((len(p.read_text().splitlines()), module_name(p)) for p in files if module_name(p).split(".")[0] in SHIPPED),
            reverse=True,
        )
        for lines, mod in sizes[:15]:
            sys.stdout.write(f"{lines:5d}  {mod}\n")
        return 0
    if args.check:
        bad = violations(edge_map) + cycles(edge_map)
        for line in bad:
            sys.stdout.write(line + "\n")
        sys.stdout.write(f"{len(bad)} layering violation(s)\n")
        return 1 if bad else 0
    if args.modules:
        for (src, dst) in sorted(edge_map):
            sys.stdout.write(f"{src} -> {dst}\n")
        return 0
    areas: dict[tuple[str, str], int] = collections.Counter()
    for (src, dst), _ in edge_map.items():
        a, b = area(src), area(dst)
        if a != b:
            areas[(a, b)] += 1
    for (a, b), n in sorted(areas.items()):
        sys.stdout.write(f"{a:24s} -> {b:24s} {n}\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:      # `... | head`
        sys.exit(0)
