"""Print the project's module graph from `ast` imports, and check its layering.

    python tools/import_graph.py              # edges between top-level areas, with counts
    python tools/import_graph.py --modules    # every module-to-module edge
    python tools/import_graph.py --check      # exit 1 if a layering rule is broken or a cycle exists
    python tools/import_graph.py --cycles     # every import cycle among modules (type-only imports too)
    python tools/import_graph.py --sizes      # the largest shipped modules

An "area" is a package one level down (`marind.agent`, `marind.trainer`, `ckpt_store`,
`bench`, `chaos`, `tests`), or a top-level module of `marind` (`marind.core.spec`). Imports inside
functions and under ``TYPE_CHECKING`` count the same as module-level ones: a lazy or type-only
import is still a dependency. ``from pkg import mod`` depends on ``pkg.mod``, not on ``pkg``'s
``__init__`` (which every import of ``pkg.mod`` runs anyway). A script in ``bench/`` or ``chaos/``
that imports a sibling by its bare name (``import goodput``) depends on that sibling.
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
SCRIPT_DIRS = ("bench", "chaos")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[str]:
    """Every dotted name ``path`` imports (``pkg.name`` for each ``from pkg import name``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    scripts = package.split(".")[0] in SCRIPT_DIRS
    found: list[str] = []

    def local(name: str) -> str:          # bench/x.py's `import goodput` is bench.goodput
        if scripts and (ROOT / package.replace(".", "/") / f"{name.split('.')[0]}.py").is_file():
            return f"{package}.{name}"
        return name

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(local(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = local(node.module or "")
            # pkg.name resolves to the module pkg.name, or else to pkg (a name defined in pkg)
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
        targets = {resolve(n, modules) for n in imports_of(path)}
        for target in targets:
            if target and target != src:
                out[(src, target)] += 1
    return out


# Layering rules: (importer prefix, imported prefix, why it is forbidden[, importers exempted]).
# A prefix names a module and everything below it (`marind.agent` is marind.agent and
# marind.agent.*); one ending in "." names only what is below it (`marind.` is every marind module).
RULES: list[tuple] = [
    ("ckpt_store", "marind", "ckpt_store is a standalone library"),
    ("ckpt_store", "trainer", "ckpt_store is a standalone library"),
    ("marind.core", "marind.", "the core sits at the bottom", ("marind.core",)),
    ("marind.control", "marind.agent", "the control-plane client is what the CLI and the agent share; the agent builds on it"),
    ("marind.control", "marind.commands", "the control-plane client sits below the CLI"),
    ("marind.control", "marind.trainer", "the control-plane client knows no program"),
    ("marind.commands", "marind.agent", "the CLI talks to the cluster through marind.control, never the daemon's code",
     ("marind.commands.agent",)),     # `marind agent` itself: the one command that starts the daemon
    ("marind.cli", "marind.agent", "the CLI talks to the cluster through marind.control, never the daemon's code"),
    ("marind.demo", "marind.agent", "the demo drives the CLI"),
    ("marind.testing", "marind.agent", "the test bed drives agents as processes, through the CLI and marind.control"),
    ("chaos", "marind.agent", "fault injectors act on processes, files and etcd, not on the daemon's code"),
    ("marind.trainer", "marind.agent", "the trainer uses the public worker and checkpoint APIs only"),
    ("marind.trainer", "marind.commands", "the trainer uses the public worker and checkpoint APIs only"),
    ("marind.trainer", "marind.control", "the trainer uses the public worker and checkpoint APIs only"),
    ("marind.trainer", "marind.rendezvous", "the trainer uses the public worker and checkpoint APIs only"),
    ("marind.agent", "marind.trainer", "the agent runs any program, not the trainer's code"),
    ("marind.agent", "marind.commands", "the agent sits below the CLI"),
    ("marind.doctor_cluster", "marind.agent", "the cluster probe sits below the agent that starts it"),
    ("marind.worker", "marind.trainer", "the worker API serves any program; the trainer builds on it"),
    ("marind.worker", "marind.agent", "the worker API talks to its agent through files only"),
    ("marind.worker", "marind.control", "the worker API talks to its agent through files only"),
    ("marind.rendezvous", "marind.trainer", "the rendezvous knows nothing of the trainer"),
    ("marind.rendezvous", "marind.agent", "torchrun loads the rendezvous; it knows nothing of the daemon"),
    ("marind.integrations", "marind.agent", "integrations drive the cluster through marind.control, as the CLI does"),
    ("marind.integrations", "marind.trainer", "integrations submit any program; they know no trainer"),
    ("marind.agent", "marind.integrations", "the daemon knows no external scheduler; integrations sit on top"),
    ("marind.control", "marind.integrations", "the control-plane client knows no external scheduler"),
    ("marind.trainer", "marind.integrations", "the trainer uses the public worker and checkpoint APIs only"),
    ("marind.worker", "marind.integrations", "the worker API knows no external scheduler"),
    ("marind.rendezvous", "marind.integrations", "the rendezvous knows no external scheduler"),
    ("marind.", "bench", "shipped code never imports benchmarks"),
    ("marind.", "chaos", "shipped code never imports chaos scripts"),
    ("bench", "tests", "bench imports shipped code, never tests"),
    ("chaos", "tests", "chaos imports shipped code, never tests"),
    ("marind", "tests", "shipped code never imports tests"),
    ("ckpt_store", "tests", "shipped code never imports tests"),
]
#: What code outside ckpt_store may import of it (shipped code and chaos; tests and benches may reach
#: inside to test and measure the parts).
CKPT_STORE_PUBLIC = ("ckpt_store", "ckpt_store.errors", "ckpt_store.export")


def within(name: str, prefix: str) -> bool:
    if prefix.endswith("."):
        return name.startswith(prefix)
    return name == prefix or name.startswith(prefix + ".")


def violations(edge_map: dict[tuple[str, str], int]) -> list[str]:
    bad = []
    for (src, dst) in sorted(edge_map):
        for src_prefix, dst_prefix, why, *exempt in RULES:
            if within(src, src_prefix) and within(dst, dst_prefix) and not any(
                    within(src, e) for e in (exempt[0] if exempt else ())):
                bad.append(f"{src} -> {dst}: {why}")
        if (src.split(".")[0] in ("marind", "chaos") and dst.split(".")[0] == "ckpt_store"
                and dst not in CKPT_STORE_PUBLIC and not dst.startswith("ckpt_store.export.")):
            bad.append(f"{src} -> {dst}: outside ckpt_store, use its public surface {CKPT_STORE_PUBLIC}")
    return bad


def cycles(edge_map: dict[tuple[str, str], int]) -> list[str]:
    """Pairs of shipped areas that import each other (dependencies must run one way)."""
    pairs = {(area(a), area(b)) for (a, b) in edge_map
             if a.split(".")[0] in SHIPPED and b.split(".")[0] in SHIPPED and area(a) != area(b)}
    return [f"{a} <-> {b}: two areas import each other" for (a, b) in sorted(pairs) if a < b and (b, a) in pairs]


def module_cycles(edge_map: dict[tuple[str, str], int]) -> list[list[str]]:
    """Every import cycle among shipped modules and scripts: the strongly connected components
    of more than one module (Tarjan's algorithm, iterative), each sorted, largest first."""
    scope = SHIPPED + SCRIPT_DIRS
    graph: dict[str, list[str]] = collections.defaultdict(list)
    for (a, b) in sorted(edge_map):
        if a.split(".")[0] in scope and b.split(".")[0] in scope:
            graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


def cycle_lines(edge_map: dict[tuple[str, str], int]) -> list[str]:
    return [f"import cycle: {' <-> '.join(c)}" for c in module_cycles(edge_map)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="module-level edges")
    parser.add_argument("--check", action="store_true", help="exit 1 on a layering violation")
    parser.add_argument("--sizes", action="store_true", help="largest shipped modules")
    parser.add_argument("--cycles", action="store_true", help="every import cycle among modules")
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
    if args.cycles:
        lines = cycle_lines(edge_map)
        for line in lines:
            sys.stdout.write(line + "\n")
        sys.stdout.write(f"{len(lines)} import cycle(s)\n")
        return 1 if lines else 0
    if args.check:
        bad = violations(edge_map) + cycles(edge_map) + cycle_lines(edge_map)
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
