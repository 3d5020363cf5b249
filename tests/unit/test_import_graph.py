"""The package's import graph (counting imports inside functions and TYPE_CHECKING blocks): no
cycles in shared/, services/ or bench/; arrows point down only: bench/ may import anything, a
service shared/ and the library parts of others, shared/ no service and no bench.

Services are the packages services/<name>/ (registry, rollout, trainer) and the launchers. One
service does not import another (they talk over HTTP and Redis), with these exceptions, listed
in the constants below so that a new one is a decision:
- LIBRARIES: parts of a service that are a plain library, no HTTP, no settings of their own.
  The rollout engine is one: the trainer replays its KV eviction to learn on the same masks.
- LAUNCHERS: the CLI and the demo start and drive the services, so they may import any of them
  (their settings, their tables); services/views.py, the launchers' formatting, only they import.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
PACKAGES = ("shared", "services", "bench")
LIBRARIES = ("services.rollout.engine",)
LAUNCHERS = ("services.cli", "services.demo")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                # The longest project module the name refers to (a module, or a name in one).
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            # A package's __init__ re-exporting its modules is not a loop of its own.
            real = [m for m in component if not any(o.startswith(m + ".") for o in component)]
            if len(real) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def _within(module: str, prefixes: str | tuple[str, ...]) -> bool:
    """`module` is one of `prefixes` or inside one of them."""
    return any(module == p or module.startswith(p + ".") for p in
               ((prefixes,) if isinstance(prefixes, str) else prefixes))


def service_of(module: str) -> str | None:
    """The service a module belongs to: services.<name> (a package or a top-level module)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "services" and len(parts) > 1 else None


def cross_service_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports of one service's module by another service that the rules above do not allow."""
    found = set()
    for module, targets in graph.items():
        source = service_of(module)
        for target in targets:
            into = service_of(target)
            if source is None or into is None or source == into or _within(module, LAUNCHERS):
                continue
            if _within(target, LIBRARIES):
                continue
            found.add((module, target))
    return found


def test_the_service_rule_finds_a_crossing() -> None:
    graph = {"services.registry.app": {"services.trainer.core", "shared.retry"},
             "services.trainer.learner": {"services.rollout.engine.replay"},
             "services.demo.live": {"services.views", "services.rollout.app"},
             "services.trainer.core": {"services.views"}}
    assert cross_service_imports(graph) == {("services.registry.app", "services.trainer.core"),
                                            ("services.trainer.core", "services.views")}


def test_no_service_imports_another() -> None:
    assert cross_service_imports(import_graph()) == set()


def test_the_libraries_import_no_other_service() -> None:
    """What another service may import is a library: it reaches no further than its own
    service's modules and shared/ (the engine imports the rollout models, not the app)."""
    graph = import_graph()
    for library in LIBRARIES:
        owner = service_of(library)
        assert {(m, t) for m, ts in graph.items() if _within(m, library) for t in ts
                if service_of(t) not in (None, owner) or _within(t, "bench")
                or (service_of(t) == owner and not _within(t, (library, f"{owner}.models")))} == set()


def test_shared_imports_no_service_and_no_bench() -> None:
    graph = import_graph()
    assert {(m, t) for m, ts in graph.items() if m.startswith("shared") for t in ts
            if t.startswith(("services", "bench"))} == set()


def test_services_import_no_bench() -> None:
    graph = import_graph()
    assert {(m, t) for m, ts in graph.items() if m.startswith("services") for t in ts
            if t.startswith("bench")} == set()


def test_generic_retry_knows_no_client() -> None:
    """shared.retry decides what is transient by the generic error types (shared.errors), not
    by importing a service's client."""
    assert not {t for t in import_graph()["shared.retry"] if t.startswith("shared.registry")}
